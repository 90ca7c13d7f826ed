"""RNN, LSTM and LSTMUnit (layers/recurrent.py) on the CPU backend.

LSTMUnit against the cell's equations in float64 and central differences. RNN and LSTM run unrolled into the
runtime's own steps; a float32 net is compared step by step with a float64 NumPy implementation of Caffe's
documented equations (forward), and its gradients with central differences of that reference (backward),
with and without expose_hidden, a static input and sequence starts (cont = 0) inside the batch, in both forms of
the input transform (over the whole sequence, per time step), which also train alike and go to the memory modes
memory.recurrent_input names.
"""
from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import GPU_ONLY
from harness import _numeric, check_gradients, cpu_net, forward, make_layer

from superneurons.errors import UserError
from superneurons.io.caffemodel import net_to_proto


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


def test_lstm_unit_reference_and_gradient(rng):
    n, hidden = 3, 2
    c_prev, x = rng.standard_normal((1, n, hidden)), rng.standard_normal((1, n, 4 * hidden))
    cont = np.array([[1.0, 0.0, 0.7]])  # a continuing stream, a new sequence, and a fraction (the formula's)
    layer, shapes = make_layer("type: 'LSTMUnit' top: 'c' top: 'h'", [c_prev.shape, x.shape, cont.shape])
    assert shapes == [(1, n, hidden)] * 2 and layer.label_bottoms == (2,)
    c, h = forward(layer, [c_prev, x, cont], shapes)
    i, f, o = (sigmoid(x[..., k * hidden:(k + 1) * hidden]) for k in range(3))
    g = np.tanh(x[..., 3 * hidden:])
    want_c = cont[..., None] * f * c_prev + i * g
    np.testing.assert_allclose(c, want_c, rtol=1e-13)
    np.testing.assert_allclose(h, o * np.tanh(want_c), rtol=1e-13)
    check_gradients("type: 'LSTMUnit' top: 'c' top: 'h'", [c_prev, x, cont], check_bottoms=[0, 1])


def test_lstm_unit_refuses_mismatched_bottoms():
    with pytest.raises(UserError, match=r"\(LSTMUnit\): the gate input \(bottom 1\) must be 4 x 3 = 12 wide, got 8"):
        make_layer("type: 'LSTMUnit' top: 'c' top: 'h'", [(1, 2, 3), (1, 2, 8), (1, 2)])
    with pytest.raises(UserError, match=r"bottom 2 must be 2-D with one time step \(1, N\), got \(2, 2\)"):
        make_layer("type: 'LSTMUnit' top: 'c' top: 'h'", [(1, 2, 3), (1, 2, 12), (2, 2)])


# ---- the unrolled layers against Caffe's equations -------------------------------------------------------

def lstm_reference(w, x, cont, x_static, h0, c0):
    """Caffe's LSTM: gate_input_t = W_hc (cont_t h_{t-1}) + W_xc x_t + b_c [+ W_xc_static x_static]; i, f, o
    sigmoid and g tanh of its four parts; c_t = cont_t f c_{t-1} + i g; h_t = o tanh(c_t)."""
    hidden = w["W_hc"].shape[1]
    h, c, outs = h0[0], c0[0], []
    static = 0 if x_static is None else x_static.reshape(len(x_static), -1) @ w["W_xc_static"].T
    for t in range(len(x)):
        k = cont[t][:, None]
        gates = (k * h) @ w["W_hc"].T + x[t].reshape(len(x[t]), -1) @ w["W_xc"].T + w["b_c"] + static
        i, f, o = (sigmoid(gates[:, j * hidden:(j + 1) * hidden]) for j in range(3))
        g = np.tanh(gates[:, 3 * hidden:])
        c = k * f * c + i * g
        h = o * np.tanh(c)
        outs.append(h)
    return np.stack(outs), h[None], c[None]


def rnn_reference(w, x, cont, x_static, h0):
    """Caffe's RNN: h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h [+ W_xh_static x_static]);
    o_t = tanh(W_ho h_t + b_o)."""
    h, outs = h0[0], []
    static = 0 if x_static is None else x_static.reshape(len(x_static), -1) @ w["W_xh_static"].T
    for t in range(len(x)):
        k = cont[t][:, None]
        h = np.tanh((k * h) @ w["W_hh"].T + x[t].reshape(len(x[t]), -1) @ w["W_xh"].T + w["b_h"] + static)
        outs.append(np.tanh(h @ w["W_ho"].T + w["b_o"]))
    return np.stack(outs), h[None]


BLOBS = {"LSTM": ["W_xc", "b_c", "W_xc_static", "W_hc"], "RNN": ["W_xh", "b_h", "W_xh_static", "W_hh", "W_ho", "b_o"]}


def recurrent_net(kind, steps, streams, dim, hidden, static, exposed):
    states = ["h", "c"] if kind == "LSTM" else ["h"]
    shapes = [(steps, streams, dim), (steps, streams)] + ([(streams, 3)] if static else [])
    names = ["x", "cont"] + (["xs"] if static else [])
    if exposed:
        shapes += [(1, streams, hidden)] * len(states)
        names += [f"{s}0" for s in states]
    inputs = "".join(f"shape {{ {' '.join(f'dim: {d}' for d in s)} }} " for s in shapes)
    tops = "out" + "".join(f"' top: '{s}T" for s in states) if exposed else "out"
    losses = "".join(f"layer {{ name: 'in_{s}' type: 'Input' top: 't_{s}' input_param {{ shape {{ dim: 1 dim: "
                     f"{streams} dim: {hidden} }} }} }} "
                     f"layer {{ name: 'loss_{s}' type: 'EuclideanLoss' bottom: '{s}T' bottom: 't_{s}' top: 'l_{s}' }} "
                     for s in states) if exposed else ""
    text = (f"force_backward: true "
            f"layer {{ name: 'in' type: 'Input' {' '.join(f'top: {n!r}' for n in names)} input_param {{ {inputs} }} }} "
            f"layer {{ name: 'target' type: 'Input' top: 'target' input_param {{ shape {{ dim: {steps} dim: {streams} "
            f"dim: {hidden} }} }} }} "
            f"layer {{ name: 'rec' type: '{kind}' {' '.join(f'bottom: {n!r}' for n in names)} top: '{tops}' "
            f"recurrent_param {{ num_output: {hidden} expose_hidden: {str(exposed).lower()} }} }} "
            f"layer {{ name: 'loss' type: 'EuclideanLoss' bottom: 'out' bottom: 'target' top: 'loss' }} " + losses)
    net = cpu_net(text)
    for blob in ["target"] + names + [f"t_{s}" for s in states if exposed]:
        net.data[blob].array[...] = 0  # the pool's memory holds whatever was there; tests fill what they use
    return net, names, states


@pytest.fixture
def form(request, monkeypatch):
    """The input transform's form every net of the test is built and run in (SUPERNEURONS_RECURRENT_INPUT)."""
    monkeypatch.setenv("SUPERNEURONS_RECURRENT_INPUT", request.param)
    return request.param


BOTH_FORMS = pytest.mark.parametrize("form", ["sequence", "step"], indirect=True)
STEP_FORM = pytest.mark.parametrize("form", ["step"], indirect=True)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static,exposed", [(False, False), (True, True)])
@BOTH_FORMS
def test_unrolled_layer_matches_caffes_equations(rng, kind, static, exposed, form):
    steps, streams, hidden = 4, 2, 3
    net, names, states = recurrent_net(kind, steps, streams, 2, hidden, static, exposed)
    assert net.graph.recurrent_input == form
    layer = net.layer("rec")
    blobs = [b for b in BLOBS[kind] if static or "static" not in b]
    assert layer.type_name == kind and len(layer.params) == len(blobs)
    w = {b: 0.6 * rng.standard_normal(decl.shape) for b, decl in zip(blobs, layer.params)}
    values = {"x": rng.standard_normal((steps, streams, 2)),
              "cont": np.array([[0, 0], [1, 1], [1, 0], [1, 1]], float),  # stream 1 starts again at t = 2
              "xs": rng.standard_normal((streams, 3)), "target": rng.standard_normal((steps, streams, hidden))}
    for s in states:
        values[f"{s}0"] = rng.standard_normal((1, streams, hidden))
        values[f"t_{s}"] = rng.standard_normal((1, streams, hidden))
    zero = np.zeros((1, streams, hidden))

    def reference():
        args = [w, values["x"], values["cont"], values["xs"] if static else None]
        args += [values[f"{s}0"] if exposed else zero for s in states]
        out, *last = (lstm_reference if kind == "LSTM" else rnn_reference)(*args)
        return out, last

    def loss():
        out, last = reference()
        total = ((out - values["target"]) ** 2).sum() / (2 * steps)
        if exposed:
            total += sum(((v - values[f"t_{s}"]) ** 2).sum() / 2 for s, v in zip(states, last))
        return total

    for decl, b in zip(layer.params, blobs):
        decl.data[...] = w[b]
    for name, v in values.items():
        if name in net.data:
            net.data[name].array[...] = v
    net.clear_param_diffs()
    net.forward_backward()
    out, last = reference()
    np.testing.assert_allclose(net.blob("out"), out, rtol=2e-5, atol=2e-6)
    if exposed:
        for s, v in zip(states, last):
            np.testing.assert_allclose(net.blob(f"{s}T"), v, rtol=2e-5, atol=2e-6)
    for decl, b in zip(layer.params, blobs):
        np.testing.assert_allclose(decl.diff, _numeric(loss, w[b], 1e-6), rtol=2e-3, atol=2e-5, err_msg=b)
    for name in names:
        if name != "cont":
            np.testing.assert_allclose(net.diff[name].array, _numeric(loss, values[name], 1e-6), rtol=2e-3,
                                       atol=2e-5, err_msg=name)


def test_caffemodel_sees_the_layer_with_caffes_blobs():
    net, _names, _states = recurrent_net("LSTM", 3, 2, 4, 5, static=False, exposed=False)
    saved = {lp.name: lp for lp in net_to_proto(net).layer}
    assert list(saved) == ["in", "target", "rec", "loss"]
    rec = saved["rec"]
    assert rec.type == "LSTM" and list(rec.bottom) == ["x", "cont"] and list(rec.top) == ["out"]
    assert [tuple(b.shape.dim) for b in rec.blobs] == [(20, 4), (20,), (20, 5)]  # W_xc, b_c, W_hc
    assert net.graph.outputs == ["loss"]
    weighted = cpu_net(str(net_to_proto(net)).replace('top: "out"', 'top: "out" loss_weight: 0.5', 1))
    assert ("out", 0.5) in weighted.graph.loss_blobs  # a loss weight on the layer's top still counts


def test_recurrent_layers_refuse_bad_bottoms():
    base = "layer { name: 'in' type: 'Input' top: 'x' top: 'cont' input_param { shape { dim: 3 dim: 2 dim: 4 } %s } } "
    lstm = "layer { name: 'lstm' type: 'LSTM' bottom: 'x' bottom: 'cont' top: 'h' recurrent_param { num_output: %d } }"
    with pytest.raises(UserError, match=r"'lstm' \(LSTM\): bottom 1 \(cont\) must be \(T, N\) = \(3, 2\), "
                                        r"got \(3, 4\)"):
        cpu_net(base % "shape { dim: 3 dim: 4 }" + lstm % 5)
    with pytest.raises(UserError, match=r"'lstm' \(LSTM\): recurrent_param.num_output must be 1 or more, got 0"):
        cpu_net(base % "shape { dim: 3 dim: 2 }" + lstm % 0)


LSTM_NET = """
layer { name: 'input' type: 'Input' top: 'data' top: 'label'
        input_param { shape { dim: 8 dim: 4 dim: 8 } shape { dim: 8 dim: 4 } } }
layer { name: 'cont' type: 'DummyData' top: 'cont'
        dummy_data_param { shape { dim: 8 dim: 4 } data_filler { type: 'constant' value: 1 } } }
layer { name: 'lstm' type: 'LSTM' bottom: 'data' bottom: 'cont' top: 'h'
        recurrent_param { num_output: 32 weight_filler { type: 'gaussian' std: 0.3 }
                          bias_filler { type: 'constant' value: 0.1 } } }
layer { name: 'fc' type: 'InnerProduct' bottom: 'h' top: 'fc'
        inner_product_param { num_output: 3 axis: 2 weight_filler { type: 'gaussian' std: 0.3 } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'fc' bottom: 'label' top: 'loss' softmax_param { axis: 2 } }
"""


@BOTH_FORMS
def test_lstm_trains_to_the_same_weights_in_every_memory_mode(form):
    """The unrolled time steps are the runtime's steps: in either form of the input transform every mode trains
    bit-identically to baseline, the pool under liveness holds what the plan says at every step, and
    recomputation trains it in a pool below liveness's peak."""
    from test_memory_modes import BACKEND, _check_modes, _graph, train

    from superneurons.runtime.net import Net

    from superneurons.memory.plan import make_plan

    _check_modes(LSTM_NET, tight=False)
    plan = make_plan(_graph(LSTM_NET), plan_backward=False)
    net, _, _ = train(LSTM_NET, "liveness", iters=2)
    assert net.memory.trace == plan.traces["liveness"].bytes
    assert max(net.memory.trace) < plan.traces["baseline"].bytes[0]
    assert plan.peak("recompute")[0] < plan.peak("liveness")[0] < plan.peak("baseline")[0]
    # A pool below liveness's peak: recomputation trains the sequence there, to baseline's weights.
    _, ref, ref_losses = train(LSTM_NET, "baseline")
    params = Net(_graph(LSTM_NET), BACKEND, memory="liveness").memory.param_bytes
    budget = params + plan.peak("liveness")[0] - 1024
    net, got, losses = train(LSTM_NET, "recompute", pool_bytes=budget)
    assert got == ref and losses == ref_losses and max(net.memory.trace) <= budget - params


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_state_carries_from_one_forward_to_the_next(rng, kind):
    """Without expose_hidden the last step's state is the next pass's initial state (Caffe's behaviour): a
    sequence cut in two batches with cont = 1 at the cut gives the outputs of the whole sequence in one batch;
    cont = 0 at the cut starts afresh."""
    whole, _, _ = recurrent_net(kind, 4, 2, 2, 3, static=False, exposed=False)
    halves, _, _ = recurrent_net(kind, 2, 2, 2, 3, static=False, exposed=False)
    for a, b in zip(whole.layer("rec").params, halves.layer("rec").params):
        a.data[...] = b.data[...] = rng.standard_normal(a.shape)
    x = rng.standard_normal((4, 2, 2))
    cont = np.array([[0, 0], [1, 1], [1, 0], [1, 1]], float)
    whole.data["x"].array[...], whole.data["cont"].array[...] = x, cont
    whole.forward()
    outs = []
    for half in (slice(0, 2), slice(2, 4)):
        halves.data["x"].array[...], halves.data["cont"].array[...] = x[half], cont[half]
        halves.forward()
        outs.append(halves.blob("out").copy())
    np.testing.assert_allclose(np.concatenate(outs), whole.blob("out"), rtol=1e-6)
    # A fresh start at the cut: the second half alone from a zero state (a new net) gives the same outputs.
    fresh, _, _ = recurrent_net(kind, 2, 2, 2, 3, static=False, exposed=False)
    for a, b in zip(fresh.layer("rec").params, halves.layer("rec").params):
        a.data[...] = b.data
    halves.data["cont"].array[...] = fresh.data["cont"].array[...] = [[0, 0], [1, 1]]
    halves.data["x"].array[...] = fresh.data["x"].array[...] = x[2:]
    halves.forward()
    fresh.forward()
    np.testing.assert_allclose(halves.blob("out"), fresh.blob("out"), rtol=1e-6)


def test_lstm_sequence_example_learns_to_recall(tmp_path, monkeypatch, capsys):
    """models/lstm_sequence: before training the net is at chance (0.25); its solver takes it to 0.99 or more."""
    import re
    import shutil
    from pathlib import Path

    from harness import load_tool
    from logs import messages

    from superneurons.cli import main

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    shutil.copytree(root / "models/lstm_sequence", tmp_path / "models/lstm_sequence")
    assert load_tool("data/make_sequence_hdf5").main([]) == 0
    assert main(["train", "--solver", "models/lstm_sequence/solver.prototxt"]) == 0
    out = "\n".join(messages(capsys.readouterr().err))
    accuracies = [float(m) for m in re.findall(r"Test net output #1: accuracy = ([0-9.]+)", out)]
    assert len(accuracies) == 2 and accuracies[0] < 0.4, out[-2000:]  # before training, then at the end
    assert accuracies[-1] >= 0.99, out[-2000:]


@BOTH_FORMS
def test_lstm_in_bfloat16_storage_trains_alike_in_every_memory_mode(form):
    """Half storage (docs/PRECISION.md) reaches the unrolled steps too: every mode bit-identical to baseline."""
    from test_memory_modes import _check_modes

    _check_modes("default_forward_type: BFLOAT16 default_backward_type: BFLOAT16\n" + LSTM_NET, tight=False)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_a_half_recurrent_layer_reads_its_input_transforms_weights_rounded(rng, kind):
    """The input transform (x and the static input, every time step in one GEMM) reads half working copies of
    its weights, as InnerProduct does, so the GPU multiplies operands of one type; the copies are planned
    tensors of the layer, holding the float32 masters rounded to bfloat16 after a forward."""
    import ml_dtypes

    net = cpu_net(f"default_forward_type: BFLOAT16 default_backward_type: BFLOAT16 "
                  f"layer {{ name: 'in' type: 'Input' top: 'x' top: 'cont' top: 'xs' input_param {{ shape {{ dim: 3 "
                  f"dim: 2 dim: 4 }} shape {{ dim: 3 dim: 2 }} shape {{ dim: 2 dim: 5 }} }} }} "
                  f"layer {{ name: 'rec' type: '{kind}' bottom: 'x' bottom: 'cont' bottom: 'xs' top: 'out' "
                  f"recurrent_param {{ num_output: 6 weight_filler {{ type: 'gaussian' std: 0.3 }} }} }}")
    for blob, shape in (("x", (3, 2, 4)), ("cont", (3, 2)), ("xs", (2, 5))):
        net.data[blob].array[...] = rng.standard_normal(shape).astype(net.data[blob].dtype)
    net.forward()
    head = next(n.layer for n in net.graph.nodes if n.name == "rec")
    copies = {name: decl for name, decl in head.buffers.items() if "copy" in name}
    assert sorted(copies) == ["static_param0_copy", "static_param0_copy_bw", "x_param0_copy", "x_param0_copy_bw"]
    for role, master in (("x", head.params[0]), ("static", head.params[2])):
        copy = copies[f"{role}_param0_copy"].array
        assert copy.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(copy, master.data.astype(ml_dtypes.bfloat16))


@STEP_FORM
def test_a_half_recurrent_layers_state_is_stored_half(form):
    """A step's transform also takes h_{t-1} as a bottom it does not read (it only orders the step): that bottom
    neither gets a gradient nor keeps the state in float32 as a label would, so W_hc h_{t-1} multiplies bfloat16
    by bfloat16 on every step."""
    from superneurons.dtypes import BFLOAT16

    net = cpu_net("default_forward_type: BFLOAT16 default_backward_type: BFLOAT16 force_backward: true "
                  "layer { name: 'in' type: 'Input' top: 'x' top: 'cont' input_param { shape { dim: 4 dim: 2 dim: 3 } "
                  "shape { dim: 4 dim: 2 } } } "
                  "layer { name: 'rec' type: 'LSTM' bottom: 'x' bottom: 'cont' top: 'out' "
                  "recurrent_param { num_output: 5 weight_filler { type: 'gaussian' std: 0.3 } } }")
    states = [b for b in net.graph.precision.data if b.startswith("rec/h_") and "conted" not in b]
    assert len(states) >= 3 and all(net.graph.precision.data[b] == BFLOAT16 for b in states), states
    transforms = [n for n in net.graph.nodes if n.name.startswith("rec/W_xc_x_") and len(n.bottoms) == 2]
    assert len(transforms) == 3 and all(n.propagate_down == [True, False] for n in transforms)


def test_a_longer_test_net_reads_every_step_weight_from_the_train_net():
    """A test net unrolled over more time steps than the train net: its extra steps share the train net's W_hc
    by name, as Caffe's test net shares the recurrent layer's blobs."""
    from superneurons.runtime.net import Net

    train, _, _ = recurrent_net("LSTM", 3, 2, 2, 3, static=False, exposed=False)
    test = Net(recurrent_net("LSTM", 5, 2, 2, 3, static=False, exposed=False)[0].graph, train.backend, train=False,
               share_params_with=train)

    def root(decl):
        while decl.owner is not None:
            decl = decl.owner
        return decl

    w_hc = root(train.layer("rec").params[-1])
    assert all(root(test.layer(name).params[-1]) is w_hc for name in ("rec", "rec/transform_1", "rec/transform_5"))


def _wide_lstm(steps):
    """LSTM_NET with streams and width large enough that one step's tensors span several pool blocks."""
    return (LSTM_NET.replace("dim: 8 dim: 4 dim: 8", f"dim: {steps} dim: 8 dim: 16")
            .replace("shape { dim: 8 dim: 4 }", f"shape {{ dim: {steps} dim: 8 }}").replace("num_output: 32", "num_output: 64"))


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@STEP_FORM
def test_recurrent_checkpoints_train_like_baseline_below_livenesss_peak(kind, form):
    """With the recurrent state as checkpoints (memory.RECURRENT_CHECKPOINTS, also what auto weighs for this
    net) offload moves the states to the host and recomputation rebuilds every step's gate input from them: both
    train, in a pool below liveness's peak, to baseline's weights bit for bit."""
    from test_memory_modes import BACKEND, _graph, train

    from superneurons.memory import RECURRENT_CHECKPOINTS, checkpoint_sets
    from superneurons.memory.plan import make_plan
    from superneurons.runtime.net import Net

    text = _wide_lstm(12).replace("type: 'LSTM'", f"type: '{kind}'")
    assert checkpoint_sets(_graph(text))[-1] == RECURRENT_CHECKPOINTS
    _, ref, ref_losses = train(text, "baseline")
    liveness = make_plan(_graph(text), plan_backward=False).peak("liveness")[0]
    plan = make_plan(_graph(text), plan_backward=False, checkpoint_types=RECURRENT_CHECKPOINTS)
    params = Net(_graph(text), BACKEND, memory="liveness").memory.param_bytes
    budget = params + liveness - 1024
    for mode in ("offload", "recompute"):
        assert plan.peak(mode)[0] < liveness
        net = Net(_graph(text), BACKEND, train=True, seed=7, pool_bytes=budget, memory=mode,
                  checkpoint_types=RECURRENT_CHECKPOINTS)
        _, got, losses = _train_net(net)
        assert got == ref and losses == ref_losses, mode
        assert max(net.memory.trace) <= budget - params, mode
        if mode == "offload":
            assert net.memory.bytes_offloaded > 0
    # auto in the same pool weighs the recurrent set too, and trains alike
    net, got, losses = train(text, "auto", pool_bytes=budget)
    assert got == ref and losses == ref_losses


def _train_net(net, iters=3):
    """test_memory_modes.train's loop on a Net already built (on either backend)."""
    rng = np.random.default_rng(1)
    losses = []
    for it in range(iters):
        net.ctx.iteration = it
        net.backend.from_host(net.data["data"].array,
                              rng.standard_normal(net.data["data"].shape).astype(np.float32))
        net.backend.from_host(net.data["label"].array,
                              rng.integers(0, 3, net.data["label"].shape).astype(np.float32))
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for decl in net.learnable:  # through the host, so a GPU net's parameters stay its device arrays
            data, diff = net.backend.to_host(decl.data), net.backend.to_host(decl.diff)
            net.backend.from_host(decl.data, data - np.float32(0.1) * diff)
    return net, [net.backend.to_host(t.array).tobytes() for t in net.tensors if t.kind == "param"], losses


@STEP_FORM
def test_recurrent_checkpoints_keep_only_the_state_per_step(form):
    """What each further time step adds to the planned peak: under liveness a step's activations (the gate input,
    4H wide, and the rest), under recompute and offload with the recurrent checkpoints only its recurrent state
    beside the net's own per-step tensors (inputs x and label, the LSTM's output h and what reads it)."""
    from test_memory_modes import _graph

    from superneurons.memory import RECURRENT_CHECKPOINTS
    from superneurons.memory.plan import make_plan

    n, hidden = 8, 64
    state = n * hidden * 4  # h_t or c_t, float32: 2 KiB, whole pool blocks
    grow = {}
    for types in (("Convolution",), RECURRENT_CHECKPOINTS):
        peaks = [make_plan(_graph(_wide_lstm(t)), plan_backward=False, checkpoint_types=types) for t in (16, 32)]
        grow[types] = {m: (peaks[1].peak(m)[0] - peaks[0].peak(m)[0]) / 16 for m in ("liveness", "offload", "recompute")}
    # x_t (16 wide), the label (T, N) and the fc/softmax tensors over (T, N, 3): under one state's bytes a step
    net_own = state
    assert grow[("Convolution",)]["liveness"] >= 4 * state + net_own  # the gate input alone is 4H wide
    rec = grow[RECURRENT_CHECKPOINTS]
    assert rec["recompute"] <= 2 * state + net_own, rec  # h_t and the output's h_t slice
    assert rec["offload"] < grow[("Convolution",)]["offload"], grow


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_the_sequence_and_step_forms_train_alike(rng, monkeypatch, kind):
    """One matrix product over the sequence and one per time step compute the same function: the same
    outputs, losses and gradients, and after three SGD steps the same weights, up to float32 rounding (the
    gradient of W_xc sums its time steps in another order). Static input, exposed state, and a stream that
    starts again inside the batch."""
    steps, streams, hidden = 6, 3, 5
    values = {"x": rng.standard_normal((steps, streams, 4)), "xs": rng.standard_normal((streams, 3)),
              "target": rng.standard_normal((steps, streams, hidden)),
              "cont": np.ones((steps, streams)), "h0": rng.standard_normal((1, streams, hidden)),
              "c0": rng.standard_normal((1, streams, hidden)), "t_h": rng.standard_normal((1, streams, hidden)),
              "t_c": rng.standard_normal((1, streams, hidden))}
    values["cont"][0] = values["cont"][3, 1] = 0
    weights = None
    runs = {}
    for form in ("sequence", "step"):
        monkeypatch.setenv("SUPERNEURONS_RECURRENT_INPUT", form)
        net, names, _states = recurrent_net(kind, steps, streams, 4, hidden, static=True, exposed=True)
        assert net.graph.recurrent_input == form
        transforms = [n for n in net.graph.nodes if n.name.startswith("rec/W_x") and n.layer.type_name == "InnerProduct"]
        assert len(transforms) == (steps - 1 if form == "step" else 0)  # the head transforms x_1, or every x_t
        assert net.graph.blob_shapes[net.graph.node("rec").tops[0]][0] == (1 if form == "step" else steps)
        params = net.layer("rec").params
        if weights is None:
            weights = [0.5 * rng.standard_normal(p.shape).astype(np.float32) for p in params]
        for p, w in zip(params, weights):
            p.data[...] = w
        for name, v in values.items():
            if name in net.data:
                net.data[name].array[...] = v
        losses, grads = [], []
        for _ in range(3):
            net.clear_param_diffs()
            losses.append(net.forward_backward())
            grads.append([p.diff.copy() for p in params] + [net.diff[b].array.copy() for b in names if b != "cont"])
            for p in net.learnable:
                p.data -= np.float32(0.2) * p.diff
        runs[form] = (losses, grads, net.blob("out").copy(), [p.data.copy() for p in params])
    (seq_losses, seq_grads, seq_out, seq_w), (step_losses, step_grads, step_out, step_w) = runs.values()
    np.testing.assert_allclose(seq_losses, step_losses, rtol=1e-6)
    np.testing.assert_allclose(seq_out, step_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(sum(seq_grads, []), sum(step_grads, [])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(seq_w, step_w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert any(not np.array_equal(a, w) for a, w in zip(seq_w, weights))  # it did train


@pytest.mark.parametrize("mode,want", [("baseline", "sequence"), ("liveness", "sequence"), ("offload", "step"),
                                       ("recompute", "step"), ("auto", "sequence")])
def test_each_memory_mode_runs_its_form_of_the_input_transform(mode, want):
    """Baseline and liveness keep every step's activations: one transform over the sequence (fewest layers per
    step). Offload and recompute keep checkpoints: per step, so they keep only the state per step. Auto: the
    sequence form where it fits (here, baseline). The Net builds the graph again where it came in the other."""
    from test_memory_modes import BACKEND, _graph, _mlp_with_loss

    from superneurons.memory import RECURRENT_CHECKPOINTS, recurrent_input
    from superneurons.runtime.net import Net

    assert recurrent_input(mode) == want
    text = _wide_lstm(6)
    graph = _graph(text)
    assert graph.recurrent_input == "sequence"  # build_graph's default
    types = RECURRENT_CHECKPOINTS if mode in ("offload", "recompute") else None
    net = Net(graph, BACKEND, memory=mode, checkpoint_types=types)
    assert net.graph.recurrent_input == want and (net.graph is graph) == (want == "sequence")
    assert net.memory.name == ("baseline" if mode == "auto" else mode)
    assert net.graph.blob_shapes[net.graph.node("lstm").tops[0]] == ((6 if want == "sequence" else 1), 8, 256)
    assert _graph(_mlp_with_loss()).recurrent_input is None  # no recurrent layer: no form


def test_the_setting_names_one_form_for_every_mode(monkeypatch):
    from test_memory_modes import BACKEND, _graph

    from superneurons.memory import MODES, auto_recurrent_inputs, recurrent_input
    from superneurons.runtime.net import Net

    assert auto_recurrent_inputs() == ("sequence", "step")
    for setting in ("sequence", "step"):
        monkeypatch.setenv("SUPERNEURONS_RECURRENT_INPUT", setting)
        assert auto_recurrent_inputs() == (setting,) and _graph(_wide_lstm(3)).recurrent_input == setting
        for mode in MODES:
            assert recurrent_input(mode) == setting
            assert Net(_graph(_wide_lstm(3)), BACKEND, memory=mode).graph.recurrent_input == setting, mode
    monkeypatch.setenv("SUPERNEURONS_RECURRENT_INPUT", "steps")
    with pytest.raises(UserError, match=r"SUPERNEURONS_RECURRENT_INPUT='steps': expected one of auto, sequence, step"):
        _graph(_wide_lstm(3))


def test_auto_runs_the_step_form_where_no_plan_of_the_sequence_form_fits(monkeypatch):
    """A pool just above the step form's recompute plan: no plan of the sequence form fits it (with the
    sequence form alone auto refuses it), so auto runs the step form, and trains to its baseline's weights."""
    from test_memory_modes import BACKEND, _graph, train

    from superneurons.memory import RECURRENT_CHECKPOINTS
    from superneurons.memory.plan import make_plan
    from superneurons.runtime.net import Net

    text = _wide_lstm(24)
    monkeypatch.setenv("SUPERNEURONS_RECURRENT_INPUT", "step")
    plan = make_plan(_graph(text), plan_backward=False, checkpoint_types=RECURRENT_CHECKPOINTS)
    _, ref, ref_losses = train(text, "baseline")
    params = Net(_graph(text), BACKEND, memory="liveness").memory.param_bytes
    budget = params + plan.peak("recompute")[0] + 4096
    monkeypatch.setenv("SUPERNEURONS_RECURRENT_INPUT", "sequence")
    with pytest.raises(UserError, match="cannot hold even the recompute plan"):
        Net(_graph(text), BACKEND, memory="auto", pool_bytes=budget)
    monkeypatch.delenv("SUPERNEURONS_RECURRENT_INPUT")
    net, got, losses = train(text, "auto", pool_bytes=budget)
    assert net.graph.recurrent_input == "step" and net.memory.name == "recompute"
    assert net.checkpoint_types == RECURRENT_CHECKPOINTS
    assert got == ref and losses == ref_losses


def test_the_memory_command_plans_the_form_each_mode_runs(tmp_path, capsys):
    """`superneurons memory`: the every-mode table in the step form (offload's and recompute's), `--memory liveness`
    in the sequence form; with a budget, auto's form as the Net picks it (sequence where a plan fits)."""
    import json

    from test_memory_modes import BACKEND, _graph

    from superneurons.cli import main
    from superneurons.memory.plan import make_plan
    from superneurons.runtime.net import Net

    text = _wide_lstm(24)
    model = tmp_path / "lstm.prototxt"
    model.write_text('name: "t"\n' + text)
    step_graph = _graph(text).in_recurrent_input("step")
    params = Net(step_graph, BACKEND, memory="recompute").memory.param_bytes
    tight = params + make_plan(step_graph, plan_backward=False).peak("recompute")[0] + 4096

    def doc(*extra):
        assert main(["memory", "--model", str(model), "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    assert doc()["recurrent_input"] == "step"
    assert doc("--memory", "liveness")["recurrent_input"] == "sequence"
    loose = doc("--gpu-memory", "64M")
    assert (loose["auto"], loose["auto_recurrent_input"]) == ("baseline", "sequence")
    narrow = doc("--gpu-memory", str(tight))
    assert (narrow["auto"], narrow["auto_recurrent_input"]) == ("recompute", "step")
    assert main(["memory", "--model", str(model)]) == 0
    assert "Recurrent layers planned with their input transform per time step" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["offload", "recompute"])
@STEP_FORM
@GPU_ONLY[0]
@GPU_ONLY[1]
def test_recurrent_checkpoints_on_the_gpu_train_like_its_baseline(gpu, mode, form):
    """On the GPU, with asynchronous copies to pinned host memory: the recurrent set below liveness's peak trains
    to the GPU baseline's weights in the same (step) form (the same kernels in the same order; bit for bit is
    expected)."""
    from test_memory_modes import _graph

    from superneurons.memory import RECURRENT_CHECKPOINTS
    from superneurons.memory.plan import make_plan
    from superneurons.runtime.net import Net

    text = _wide_lstm(24)
    liveness = make_plan(_graph(text), plan_backward=False).peak("liveness")[0]
    params = Net(_graph(text), gpu, memory="liveness").memory.param_bytes
    budget = params + liveness - 1024

    def weights(net):
        return _train_net(net)[1:]

    ref = weights(Net(_graph(text), gpu, train=True, seed=7, memory="baseline"))
    net = Net(_graph(text), gpu, train=True, seed=7, pool_bytes=budget, memory=mode,
              checkpoint_types=RECURRENT_CHECKPOINTS)
    assert weights(net) == ref
    assert max(net.memory.trace) <= budget - params


@GPU_ONLY[0]
@GPU_ONLY[1]
def test_the_sequence_and_step_forms_train_alike_on_the_gpu(gpu, monkeypatch):
    """On the GPU too the two forms of the input transform train to the same weights up to float32 rounding
    (cuBLAS may also pick other kernels for the (T N, D) product than for the (N, D) ones)."""
    from test_memory_modes import _graph

    from superneurons.runtime.net import Net

    runs = {}
    for form in ("sequence", "step"):
        monkeypatch.setenv("SUPERNEURONS_RECURRENT_INPUT", form)
        net = Net(_graph(_wide_lstm(16)), gpu, train=True, seed=7, memory="baseline")
        assert net.graph.recurrent_input == form
        _, weights, losses = _train_net(net)
        runs[form] = ([np.frombuffer(w, np.float32) for w in weights], losses)
    (seq_w, seq_losses), (step_w, step_losses) = runs.values()
    np.testing.assert_allclose(seq_losses, step_losses, rtol=1e-5)
    for a, b in zip(seq_w, step_w):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
