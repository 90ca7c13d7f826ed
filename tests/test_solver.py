"""Solvers, lr policies, snapshots/resume, weights I/O and DummyData, against NumPy float64 references."""
from __future__ import annotations

import math
import os
import signal
import time

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.caffemodel import load_weights, net_to_proto, save_weights
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.logging import TrainLog
from superneurons.runtime.net import Net
from superneurons.solver import Solver
from superneurons.solver.lr_policy import LrPolicy

OPS = CpuBackend().ops

TINY_NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 }
    shape { dim: 8 dim: 6 } shape { dim: 8 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def solver_param(text: str = "", net: str = TINY_NET) -> pb.SolverParameter:
    p = text_format.Parse(text, pb.SolverParameter())
    p.net_param.CopyFrom(text_format.Parse(net, pb.NetParameter()))
    if not p.HasField("random_seed"):
        p.random_seed = 3
    return p


class Quiet(TrainLog):
    """Collects log lines instead of printing them."""

    def __init__(self):
        super().__init__(stream=open(os.devnull, "w"))
        self.lines: list[str] = []

    def info(self, line: str) -> None:
        self.lines.append(line)


def make_solver(text: str, **kw) -> Solver:
    return Solver(solver_param(text, **kw), "test_solver.prototxt", log=Quiet())


# ---- update rules -------------------------------------------------------------------------------------------

def _reference_step(kind, w, g, state, lr, t, mom=0.9, mom2=0.999, delta=1e-8, rms=0.98):
    """Textbook forms of Caffe's rules in float64; returns the new w (state updated in place)."""
    if kind == "SGD":
        state["v"] = mom * state["v"] + lr * g
        return w - state["v"]
    if kind == "Nesterov":
        old = state["v"].copy()
        state["v"] = mom * state["v"] + lr * g
        return w - ((1 + mom) * state["v"] - mom * old)
    if kind == "AdaGrad":
        state["h"] = state["h"] + g ** 2
        return w - lr * g / (np.sqrt(state["h"]) + delta)
    if kind == "RMSProp":
        state["h"] = rms * state["h"] + (1 - rms) * g ** 2
        return w - lr * g / (np.sqrt(state["h"]) + delta)
    if kind == "AdaDelta":
        state["g2"] = mom * state["g2"] + (1 - mom) * g ** 2
        dx = np.sqrt((state["dx2"] + delta) / (state["g2"] + delta)) * g
        state["dx2"] = mom * state["dx2"] + (1 - mom) * dx ** 2
        return w - lr * dx
    if kind == "Adam":
        state["m"] = mom * state["m"] + (1 - mom) * g
        state["v"] = mom2 * state["v"] + (1 - mom2) * g ** 2
        # Caffe folds the bias corrections into the rate and adds eps to sqrt(v) (not to sqrt(v_hat)).
        rate = lr * math.sqrt(1 - mom2 ** t) / (1 - mom ** t)
        return w - rate * state["m"] / (np.sqrt(state["v"]) + delta)
    raise AssertionError(kind)


def _op_step(kind, w, dw, hist, lr, t, mom=0.9, mom2=0.999, delta=1e-8, rms=0.98):
    if kind == "SGD":
        OPS.sgd_update(w, dw, hist[0], lr, mom)
    elif kind == "Nesterov":
        OPS.nesterov_update(w, dw, hist[0], lr, mom)
    elif kind == "AdaGrad":
        OPS.adagrad_update(w, dw, hist[0], lr, delta)
    elif kind == "RMSProp":
        OPS.rmsprop_update(w, dw, hist[0], lr, rms, delta)
    elif kind == "AdaDelta":
        OPS.adadelta_update(w, dw, hist[0], hist[1], lr, mom, delta)
    else:
        OPS.adam_update(w, dw, hist[0], hist[1], lr, mom, mom2, delta, t)


KINDS = ["SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"]


@pytest.mark.parametrize("kind", KINDS)
def test_update_op_matches_reference_for_two_steps(kind):
    rng = np.random.default_rng()
    w = rng.standard_normal((3, 5))
    ref_w = w.copy()
    hist = [np.zeros_like(w), np.zeros_like(w)]
    state = {k: np.zeros_like(w) for k in ("v", "h", "g2", "dx2", "m")}
    for t in (1, 2):
        g = rng.standard_normal(w.shape)
        lr = 0.05 * t
        _op_step(kind, w, g.copy(), hist, lr, t)
        ref_w = _reference_step(kind, ref_w, g, state, lr, t)
        np.testing.assert_allclose(w, ref_w, rtol=1e-12, atol=1e-14, err_msg=f"{kind} step {t}")
    assert not np.allclose(w, ref_w + 1e-3)


def test_regularize_l1_and_l2():
    rng = np.random.default_rng()
    w, g = rng.standard_normal(7), rng.standard_normal(7)
    dw = g.copy()
    OPS.regularize(w, dw, 0.3)
    np.testing.assert_allclose(dw, g + 0.3 * w)
    dw = g.copy()
    OPS.regularize(w, dw, 0.3, l1=True)
    np.testing.assert_allclose(dw, g + 0.3 * np.sign(w))


def _set_random_diffs(solver, rng):
    grads = []
    for decl in solver.net.learnable:
        g = rng.standard_normal(decl.shape).astype(np.float32)
        decl.diff[...] = g
        grads.append(g.astype(np.float64))
    return grads


@pytest.mark.parametrize("reg", ["L2", "L1"])
def test_solver_update_uses_decay_and_lr_mults(reg):
    """SGD through the solver: diff + weight_decay*decay_mult*(w or sign w), rate*lr_mult, momentum, two steps."""
    solver = make_solver(f'type: "SGD" base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 '
                         f'regularization_type: "{reg}" max_iter: 2')
    rng = np.random.default_rng()
    decls = solver.net.learnable
    assert [d.lr_mult for d in decls] == [1, 2, 1, 1] and [d.decay_mult for d in decls] == [1, 0, 1, 1]
    w = [d.data.astype(np.float64) for d in decls]
    v = [np.zeros_like(x) for x in w]
    for it in range(2):
        grads = _set_random_diffs(solver, rng)
        solver.apply_update()
        solver.iter += 1
        for k, d in enumerate(decls):
            reg_term = w[k] if reg == "L2" else np.sign(w[k])
            v[k] = 0.9 * v[k] + 0.1 * d.lr_mult * (grads[k] + 0.01 * d.decay_mult * reg_term)
            w[k] = w[k] - v[k]
            np.testing.assert_allclose(d.data, w[k], rtol=1e-5, atol=1e-6, err_msg=f"param {k} iter {it}")


def test_clip_gradients_scales_by_global_norm():
    solver = make_solver('base_lr: 1 lr_policy: "fixed" clip_gradients: 0.5 max_iter: 1')
    rng = np.random.default_rng()
    before = [d.data.astype(np.float64) for d in solver.net.learnable]
    grads = _set_random_diffs(solver, rng)
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    assert norm > 0.5
    solver.apply_update()
    steps = [b - d.data for b, d in zip(before, solver.net.learnable)]
    # lr_mult 2 on ip1's bias doubles its step; undo it to see the clipped gradient.
    steps[1] /= 2
    for s, g in zip(steps, grads):
        np.testing.assert_allclose(s, g * 0.5 / norm, rtol=1e-4, atol=1e-6)
    assert any("Gradient clipping" in line for line in solver.log.lines)


def test_iter_size_averages_the_passes_diffs():
    text = 'base_lr: 0.5 lr_policy: "fixed" iter_size: 2 max_iter: 1'
    probe, solver = make_solver(text), make_solver(text)
    w0 = [d.data.astype(np.float64) for d in probe.net.learnable]
    total = [np.zeros_like(x) for x in w0]
    for k in range(2):  # the two passes of iteration 0 are forward passes 0 and 1
        probe.net.clear_param_diffs()
        probe.net.ctx.iteration = k
        probe.net.forward_backward()
        for t, d in zip(total, probe.net.learnable):
            t += d.diff
    assert not np.allclose(total[0], 2 * probe.net.learnable[0].diff)  # the passes saw different batches
    solver.step(1)
    for k, (w, t, d) in enumerate(zip(w0, total, solver.net.learnable)):
        np.testing.assert_allclose(d.data, w - 0.5 * d.lr_mult * t / 2, rtol=1e-5, atol=1e-6, err_msg=f"param {k}")


# ---- lr policies --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,fields,formula", [
    ("fixed", "", lambda it: 0.1),
    ("step", "gamma: 0.5 stepsize: 7", lambda it: 0.1 * 0.5 ** (it // 7)),
    ("exp", "gamma: 0.97", lambda it: 0.1 * 0.97 ** it),
    ("inv", "gamma: 0.0001 power: 0.75", lambda it: 0.1 * (1 + 0.0001 * it) ** -0.75),
    ("poly", "power: 2 max_iter: 50", lambda it: 0.1 * (1 - it / 50) ** 2),
    ("sigmoid", "gamma: -0.2 stepsize: 20", lambda it: 0.1 / (1 + math.exp(0.2 * (it - 20)))),
    ("multistep", "gamma: 0.1 stepvalue: 5 stepvalue: 9 stepvalue: 30",
     lambda it: 0.1 * 0.1 ** sum(it >= s for s in (5, 9, 30))),
])
def test_lr_policy_formula(policy, fields, formula):
    p = text_format.Parse(f'base_lr: 0.1 lr_policy: "{policy}" {fields}', pb.SolverParameter())
    lr = LrPolicy(p)
    for it in range(41):  # every iteration, as the solver asks (multistep advances one step per call)
        rate = lr.rate(it)
        assert rate == pytest.approx(formula(it), rel=1e-5)  # fields are float32, f"{policy} at {it}"
    if policy == "multistep":
        assert lr.current_step == 3


def test_lr_policy_errors_name_the_file():
    with pytest.raises(UserError, match=r"s\.prototxt.*stepsize"):
        LrPolicy(text_format.Parse('lr_policy: "step"', pb.SolverParameter()), "s.prototxt")
    with pytest.raises(UserError, match="unknown lr_policy 'cosine'"):
        LrPolicy(text_format.Parse('lr_policy: "cosine"', pb.SolverParameter()), "s.prototxt")


# ---- training -----------------------------------------------------------------------------------------------

TRAINS = {
    "SGD": 'base_lr: 0.1 momentum: 0.9',
    "Nesterov": 'base_lr: 0.1 momentum: 0.9',
    "AdaGrad": 'base_lr: 0.1',
    "RMSProp": 'base_lr: 0.01 rms_decay: 0.98',
    "AdaDelta": 'base_lr: 1.0 momentum: 0.95 delta: 1e-6',
    "Adam": 'base_lr: 0.01 momentum: 0.9 momentum2: 0.999',
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_solver_type_lowers_the_loss(kind):
    solver = make_solver(f'type: "{kind}" lr_policy: "fixed" weight_decay: 0.0005 max_iter: 30 '
                         f'snapshot_after_train: false {TRAINS[kind]}')
    solver.param.random_seed = int(np.random.default_rng().integers(1 << 20))
    losses = []
    solver.callbacks.append(lambda s, it, loss: losses.append(loss))
    solver.solve()
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    assert solver.log.lines[-1] == "Optimization Done."


def test_unknown_solver_type_is_a_user_error():
    with pytest.raises(UserError, match="unknown solver type 'Lion'.*SGD, Nesterov"):
        make_solver('type: "Lion"')


def _snapshot_solver_text(kind: str, max_iter: int) -> str:
    return (f'type: "{kind}" {TRAINS[kind]} lr_policy: "multistep" gamma: 0.5 stepvalue: 4 stepvalue: 12 '
            f'max_iter: {max_iter} snapshot: 10 snapshot_prefix: "snap/tiny" weight_decay: 0.001 '
            'test_iter: 2 test_interval: 5 display: 5 random_seed: -1')


@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_resume_from_snapshot_gives_byte_identical_model(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    full = make_solver(_snapshot_solver_text(kind, 20))
    full.solve()
    uninterrupted = (tmp_path / "snap/tiny_iter_20.caffemodel").read_bytes()
    state = pb.SolverState.FromString((tmp_path / "snap/tiny_iter_10.solverstate").read_bytes())
    assert state.iter == 10 and state.current_step == 1
    assert state.learned_net == "snap/tiny_iter_10.caffemodel"
    assert len(state.history) == (2 if kind == "Adam" else 1) * len(full.net.learnable)

    os.remove(tmp_path / "snap/tiny_iter_20.caffemodel")
    resumed = make_solver(_snapshot_solver_text(kind, 20))  # random_seed -1: a new clock seed, restored from the sidecar
    resumed.solve(resume="snap/tiny_iter_10.solverstate")
    assert resumed.seed == full.seed and resumed.iter == 20
    assert (tmp_path / "snap/tiny_iter_20.caffemodel").read_bytes() == uninterrupted
    assert resumed.lr_policy.current_step == 2


def test_layer_state_goes_through_the_sidecar(tmp_path, monkeypatch):
    """A layer with state()/restore() (the LMDB Data layer's cursor) is saved beside the solverstate and restored."""
    monkeypatch.chdir(tmp_path)
    text = 'base_lr: 0.1 max_iter: 3 snapshot_prefix: "s"'
    solver = make_solver(text)
    cursor = int(np.random.default_rng().integers(1000))
    layer = solver.net.layer("data")
    layer.state, layer.restore = (lambda: {"cursor": np.int64(cursor)}), (lambda s: None)
    solver.solve()
    resumed = make_solver(text)
    got = []
    layer = resumed.net.layer("data")
    layer.state, layer.restore = (lambda: {}), got.append
    resumed.restore("s_iter_3.solverstate")
    assert got == [{"cursor": cursor}] and resumed.iter == 3


def test_same_seed_same_weights_and_other_seed_differs(tmp_path):
    def run(seed):
        s = make_solver(f'base_lr: 0.1 momentum: 0.9 max_iter: 5 random_seed: {seed} snapshot_after_train: false')
        s.solve()
        return net_to_proto(s.net).SerializeToString()

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_sigint_finishes_the_iteration_and_snapshots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = make_solver('base_lr: 0.1 max_iter: 100 snapshot_prefix: "snap/x"')

    def interrupt(s, it, loss):
        if it == 4:
            os.kill(os.getpid(), signal.SIGINT)

    solver.callbacks.append(interrupt)
    solver.solve()
    assert solver.iter == 4
    assert (tmp_path / "snap/x_iter_4.solverstate").exists() and (tmp_path / "snap/x_iter_4.caffemodel").exists()
    assert "Optimization stopped early. Resume with --snapshot snap/x_iter_4.solverstate" in solver.log.lines
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_sigint_swallowed_by_a_callback_still_stops_without_a_snapshot(tmp_path, monkeypatch):
    """The second Ctrl-C's KeyboardInterrupt can land inside a ctypes callback (numba's compiler calls back
    into Python), which prints and drops it: the run must still stop at once, not snapshot as the first asked."""
    monkeypatch.chdir(tmp_path)
    solver = make_solver('base_lr: 0.1 max_iter: 100 snapshot_prefix: "snap/x"')

    def interrupt_twice_and_swallow(s, it, loss):
        if it == 2:
            os.kill(os.getpid(), signal.SIGINT)  # stop after this iteration
            try:
                os.kill(os.getpid(), signal.SIGINT)  # ... no: at once
                time.sleep(1)
            except KeyboardInterrupt:
                pass  # what a ctypes callback does with it

    solver.callbacks.append(interrupt_twice_and_swallow)
    with pytest.raises(KeyboardInterrupt):
        solver.solve()
    assert solver.iter == 2 and not (tmp_path / "snap").exists()


# ---- weights I/O --------------------------------------------------------------------------------------------

def _net(seed: int, text: str = TINY_NET) -> Net:
    graph = build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)
    return Net(graph, CpuBackend(), train=True, seed=seed)


def test_weights_round_trip_and_caffe_layout(tmp_path):
    a, b = _net(int(np.random.default_rng().integers(1 << 30))), _net(5)
    path = str(tmp_path / "w.caffemodel")
    save_weights(a, path)
    saved = pb.NetParameter.FromString(open(path, "rb").read())
    assert [l.name for l in saved.layer] == ["data", "ip1", "relu1", "ip2", "loss"]
    assert [list(bl.shape.dim) for bl in saved.layer[1].blobs] == [[10, 6], [10]]
    assert saved.layer[1].type == "InnerProduct" and list(saved.layer[1].bottom) == ["data"]
    report = load_weights(b, path)
    assert report.copied == ["ip1", "ip2"] and report.missing == [] and report.ignored == []
    for da, db in zip(a.learnable, b.learnable):
        np.testing.assert_array_equal(da.data, db.data)


def test_load_weights_reports_missing_ignored_and_mis_shaped(tmp_path):
    path = str(tmp_path / "w.caffemodel")
    save_weights(_net(1), path)
    renamed = _net(2, TINY_NET.replace('"ip2"', '"fc_new"'))
    report = load_weights(renamed, path)
    assert report.ignored == ["ip2"] and report.missing == ["fc_new"] and report.copied == ["ip1"]
    wider = _net(2, TINY_NET.replace("num_output: 10", "num_output: 12"))
    with pytest.raises(UserError, match=r"w\.caffemodel.*'ip1'.*file has \(10 6\), net has \(12 6\)"):
        load_weights(wider, path)


# ---- DummyData ----------------------------------------------------------------------------------------------

def test_dummy_data_shapes_and_deterministic_refill():
    net = _net(9, TINY_NET.replace("shape { dim: 8 dim: 6 } shape { dim: 8 }",
                                   "num: 8 num: 8 channels: 6 channels: 1 height: 1 width: 1"))
    assert net.graph.blob_shapes["data"] == (8, 6, 1, 1) and net.graph.blob_shapes["label"] == (8, 1, 1, 1)
    layer = net.layer("data")

    def batch(it):
        net.ctx.iteration = it
        net.forward()
        return net.blob("data"), net.blob("label")

    d0, l0 = batch(0)
    d1, _ = batch(1)
    d0_again, _ = batch(0)
    assert np.array_equal(d0, d0_again) and not np.allclose(d0, d1)
    assert np.all(l0 == 2) and 0.5 < d0.std() < 1.5
    assert layer.is_data


def test_dummy_data_rejects_bad_filler_count():
    bad = TINY_NET.replace('data_filler { type: "constant" value: 2 }',
                           'data_filler { type: "constant" } data_filler { type: "constant" }')
    with pytest.raises(UserError, match="'data'.*3 data_filler.*2 top"):
        _net(0, bad)


def test_hdf5_snapshot_resumes_to_the_same_weights(tmp_path, monkeypatch):
    pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    text = _snapshot_solver_text("Adam", 12).replace("max_iter", 'snapshot_format: HDF5 max_iter')
    full = make_solver(text)
    full.solve()
    expected = net_to_proto(full.net)
    assert (tmp_path / "snap/tiny_iter_10.solverstate.h5").exists()
    resumed = make_solver(text)
    resumed.solve(resume="snap/tiny_iter_10.solverstate.h5")
    assert net_to_proto(resumed.net) == expected
    fresh = _net(0)
    assert load_weights(fresh, "snap/tiny_iter_12.caffemodel.h5").copied == ["ip1", "ip2"]
    np.testing.assert_array_equal(fresh.learnable[0].data, resumed.net.learnable[0].data)


def test_average_loss_and_test_compute_loss():
    solver = make_solver('base_lr: 0.1 max_iter: 7 average_loss: 3 display: 1 test_iter: 2 test_interval: 5 '
                         'test_compute_loss: true snapshot_after_train: false')
    losses = []
    solver.callbacks.append(lambda s, it, loss: losses.append(loss))
    solver.step(7)
    assert solver.smoothed_loss == pytest.approx(np.mean(losses[-3:]), rel=1e-6)
    lines = solver.log.lines
    assert lines.count("Iteration 5, Testing net (#0)") == 1
    test_loss = float(lines[lines.index("Iteration 5, Testing net (#0)") + 1].split("Test loss: ")[1])
    reported = [l for l in lines if l.startswith("    Test net output #1: loss = ")]
    assert float(reported[-1].split(" = ")[1].split()[0]) == pytest.approx(test_loss, rel=1e-5)


def test_load_weights_accepts_legacy_4d_and_double_blobs():
    """Old model-zoo .caffemodels store (num, channels, height, width) instead of `shape`."""
    rng = np.random.default_rng()
    w, b = rng.standard_normal((10, 6)), rng.standard_normal(10)
    model = pb.NetParameter()
    layer = model.layer.add(name="ip1")
    layer.blobs.add(num=1, channels=1, height=10, width=6).data.extend(w.ravel().tolist())
    layer.blobs.add(num=1, channels=1, height=1, width=10).double_data.extend(b.tolist())
    net = _net(0)
    assert load_weights(net, model).copied == ["ip1"]
    np.testing.assert_array_equal(net.learnable[0].data, w.astype(np.float32))
    np.testing.assert_array_equal(net.learnable[1].data, b.astype(np.float32))
    layer.blobs[0].height = 12
    with pytest.raises(UserError, match=r"'ip1'.*\(1 1 12 6\).*\(10 6\)"):
        load_weights(net, model)
