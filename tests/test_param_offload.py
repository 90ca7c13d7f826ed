"""Parameters are tensors too: weights, gradients and solver history go through the pool, and
when the pool cannot hold them all beside the activations they are streamed from the host, one layer at a
time, and the update runs one parameter at a time. The weights and the history must equal baseline's."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb
from superneurons.solver import Solver
from superneurons.solver.fused_update import CHUNK
from test_memory_modes import CONV_FAN
from test_recompute_resnet import RESNET
from test_solver import Quiet, solver_param

SOLVERS = {
    "sgd": 'type: "SGD" base_lr: 0.05 momentum: 0.9 weight_decay: 0.01 max_iter: 3',
    "clip_iter_size": ('type: "SGD" base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 clip_gradients: 0.5 '
                       'iter_size: 2 max_iter: 3'),
    "adam_l1": 'type: "Adam" base_lr: 0.01 momentum: 0.9 momentum2: 0.999 weight_decay: 0.01 '
               'regularization_type: "L1" max_iter: 3',
}


def _dummy(net_text: str) -> str:
    """The exactness nets read an Input layer; the solver needs data it draws itself (DummyData)."""
    head, _, rest = net_text.partition("\n")
    shape = text_format.Parse(head.strip()[len("layer "):].strip()[1:-1], pb.LayerParameter()).input_param.shape
    dims = [" ".join(f"dim: {d}" for d in s.dim) for s in shape]
    return ('name: "t"\nlayer { name: "input" type: "DummyData" top: "data" top: "label" dummy_data_param { '
            'data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } '
            + " ".join(f"shape {{ {d} }}" for d in dims) + " } }\n" + rest)


def _train(net_text: str, solver_text: str, memory: str, pool_bytes=None, test_nets: bool = False):
    # No final snapshot: it would land in the working directory, and these tests compare weights in memory.
    text = solver_text + " snapshot_after_train: false" + (" test_iter: 1 test_interval: 2" if test_nets else "")
    solver = Solver(solver_param(text, net=net_text), "s.prototxt", memory=memory, pool_bytes=pool_bytes, log=Quiet())
    solver.solve()
    weights = [t.array.tobytes() for t in solver.net.tensors if t.kind == "param"]
    history = [h.tobytes() for h in solver.history_blobs()]
    return solver, weights, history


@pytest.mark.parametrize("solver_text", list(SOLVERS.values()), ids=list(SOLVERS))
@pytest.mark.parametrize("net_text", [CONV_FAN, RESNET], ids=["fan", "resnet"])
def test_streamed_parameters_train_to_baseline_weights(monkeypatch, net_text, solver_text):
    net_text = _dummy(net_text)
    _, ref_w, ref_h = _train(net_text, solver_text, "baseline")
    monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "1")
    for mode in ("liveness", "offload", "recompute"):
        solver, w, h = _train(net_text, solver_text, mode)
        assert solver.net.params.offloaded
        assert w == ref_w, f"{mode}: weights differ"
        assert h == ref_h, f"{mode}: solver history differs"


def test_a_budget_below_the_parameters_streams_them_and_still_trains(monkeypatch):
    net_text = _dummy(RESNET)
    text = SOLVERS["sgd"]
    base, ref_w, ref_h = _train(net_text, text, "baseline", test_nets=True)
    params = sum(t.nbytes for t in base.net.tensors if t.kind in ("param", "param_diff", "history"))
    from superneurons.memory.plan import make_plan

    # planned as the solver's Net is: with the grouped update's tables (resident even when the parameters stream)
    plan = make_plan(base.net.graph, plan_backward=False, solver_history=len(base.net.history),
                     update_chunk=CHUNK)
    budget = plan.peak("recompute")[0] + params // 2  # the parameters alone would not fit beside the peak
    solver, w, h = _train(net_text, text, "recompute", pool_bytes=budget, test_nets=True)
    assert solver.net.params.offloaded and solver.net.pool.capacity < params + plan.peak("recompute")[0]
    assert w == ref_w and h == ref_h
    assert solver.net.pool.high_water <= budget


def test_resident_parameters_and_history_are_pool_tensors():
    solver = Solver(solver_param(SOLVERS["adam_l1"], net=_dummy(CONV_FAN)), "s.prototxt", memory="liveness",
                    log=Quiet())
    assert not solver.net.params.offloaded
    pool = solver.net.pool
    for hist_set in solver.net.history:
        for t in hist_set:
            assert pool.owns(t.key) and not np.asarray(t.array).any()  # in the pool, zeroed
    assert len(solver.history_blobs()) == 2 * len(solver.net.learnable)


def test_planner_accounts_for_streamed_parameters():
    from superneurons.graph.build import build_graph
    from superneurons.memory.cost import choose
    from superneurons.memory.plan import make_plan

    graph = build_graph(text_format.Parse(_dummy(RESNET), pb.NetParameter()), pb.TRAIN)
    plan = make_plan(graph, solver_history=1)

    def auto(budget):  # auto restricted to this plan's checkpoint set
        return choose(budget, [plan.checkpoint_types], lambda types, modes, recompute_limit=0: plan)

    need = plan.peak("recompute")[0] + plan.param_bytes
    resident = auto(need)
    assert resident.mode == "recompute" and not resident.streams_params
    streamed = plan.streamed_peak("recompute")
    assert plan.max_layer[1] <= streamed < need
    picked = auto(streamed)
    assert picked.mode == "recompute" and picked.streams_params
    with pytest.raises(UserError, match="streamed"):
        auto(streamed - 4096)


@pytest.mark.slow
def test_make_resnet_with_more_parameters_than_the_budget_trains(monkeypatch):
    from tools.models.make_resnet import make_resnet

    net = make_resnet([1, 1, 1, 1], batch=2, classes=4, side=32)
    net_text = text_format.MessageToString(net)
    text = 'type: "SGD" base_lr: 0.01 momentum: 0.9 weight_decay: 0.0001 max_iter: 2'
    base, ref_w, ref_h = _train(net_text, text, "baseline")
    params = sum(t.nbytes for t in base.net.tensors if t.kind in ("param", "param_diff", "history"))
    solver, w, h = _train(net_text, text, "recompute", pool_bytes=params // 3)
    assert solver.net.params.offloaded and w == ref_w and h == ref_h


def test_snapshots_and_weight_files_of_streamed_parameters_read_the_host_homes(monkeypatch, tmp_path):
    """With streamed parameters, weights and history live in host homes between steps. Weight files and
    snapshots reach them through the Net's backend (runtime.net.HostAwareBackend), never through the device
    backend's to_host/from_host, which on the GPU take device arrays only."""
    from superneurons.backend.cpu import CpuBackend
    from superneurons.solver.snapshot import restore_snapshot, write_snapshot

    homes: set[int] = set()

    class DeviceOnly(CpuBackend):
        def to_host(self, src):
            assert id(src) not in homes, "a host home reached the device backend's to_host"
            return super().to_host(src)

        def from_host(self, dst, src):
            assert id(dst) not in homes, "a host home reached the device backend's from_host"
            super().from_host(dst, src)

    monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "1")
    text = SOLVERS["sgd"] + f' snapshot_after_train: false snapshot_prefix: "{tmp_path}/s"'

    def solver():
        s = Solver(solver_param(text, net=_dummy(CONV_FAN)), "s.prototxt", memory="liveness", log=Quiet(),
                   backend=DeviceOnly())
        assert s.net.params.offloaded
        homes.update(id(h) for h in s.net.params.home.values())
        return s

    first = solver()
    first.solve()
    _model, state = write_snapshot(first)
    second = solver()
    restore_snapshot(second, state)
    weights = lambda s: [t.array.tobytes() for t in s.net.tensors if t.kind == "param"]  # noqa: E731
    assert weights(second) == weights(first)
    assert [h.tobytes() for h in second.history_blobs()] == [h.tobytes() for h in first.history_blobs()]


def test_replayed_steps_read_streamed_weights_from_the_device(monkeypatch):
    """Recompute replays forward steps inside backward. With streamed parameters the replay must bring the
    step's weights in as the original forward did: a host home standing in for them computes the right
    numbers on the CPU, but on the GPU it is a NumPy array a kernel cannot take (AlexNet, widest batch)."""
    from superneurons.memory.params import layers_computed_by
    from superneurons.memory.plan import make_plan

    # Block checkpoints: the convolutions inside a residual block are replayed, weights and all.
    net_text, text = _dummy(RESNET), SOLVERS["sgd"] + ' memory_param { checkpoint_type: "Eltwise" }'

    base, ref_w, _ = _train(net_text, text, "baseline")
    # The pool the recompute plan (Eltwise checkpoints) needs with the parameters streamed: they cannot stay.
    plan = make_plan(base.net.graph, plan_backward=False, checkpoint_types=("Eltwise",),
                     solver_history=len(base.net.history), update_chunk=CHUNK)
    solver = Solver(solver_param(text + " snapshot_after_train: false", net=net_text), "s.prototxt",
                    memory="recompute", pool_bytes=plan.streamed_peak("recompute"), log=Quiet())
    store = solver.net.params
    assert store.offloaded
    seen = {"replays": 0, "homes": []}
    nodes = solver.net.graph.nodes
    for node, computed in zip(nodes, layers_computed_by(solver.net.graph)):  # a fused BatchNorm applies its Scale's weights
        decls = [(f"{c.name} param {k}", d) for c in computed for k, d in enumerate(c.params)]

        def checked(bottom, top, _decls=decls, _forward=node.layer.forward):
            seen["replays"] += solver.net.ctx.recomputing and bool(_decls)
            seen["homes"] += [name for name, d in _decls if store.home_key(d.data) is not None]
            return _forward(bottom, top)

        node.layer.forward = checked
    solver.solve()
    assert seen["replays"] > 0, "the net must replay a layer with weights for this test to mean anything"
    assert seen["homes"] == []
    assert [t.array.tobytes() for t in solver.net.tensors if t.kind == "param"] == ref_w
