"""Every memory mode trains to byte-identical weights on the CPU, and the pool holds what the plan says."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import PoolExhausted, UserError
from superneurons.graph.build import build_graph
from superneurons.memory.liveness import OFFLOAD, PREFETCH, Schedule, simulate
from superneurons.memory.plan import make_plan
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

BACKEND = CpuBackend()


def _layer(name, type_, bottoms, tops, extra=""):
    b = "".join(f' bottom: "{x}"' for x in bottoms)
    t = "".join(f' top: "{x}"' for x in tops)
    return f'layer {{ name: "{name}" type: "{type_}"{b}{t} {extra} }}\n'


def _input(shape, classes_batch):
    dims = " ".join(f"dim: {d}" for d in shape)
    return _layer("input", "Input", [], ["data", "label"],
                  f"input_param {{ shape {{ {dims} }} shape {{ dim: {classes_batch} }} }}")


W = 'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0.1 }'


def conv(name, bottom, top, n, k=3, pad=1):
    return _layer(name, "Convolution", [bottom], [top],
                  f"convolution_param {{ num_output: {n} kernel_size: {k} pad: {pad} {W} }}")


def ip(name, bottom, top, n):
    return _layer(name, "InnerProduct", [bottom], [top], f"inner_product_param {{ num_output: {n} {W} }}")


MLP_FAN = (  # Split + Eltwise-free join through InnerProduct sums: works with the core layers only
    _input((4, 6), 4)
    + ip("fc1", "data", "fc1", 8) + _layer("relu1", "ReLU", ["fc1"], ["fc1"])
    + ip("fa", "fc1", "fa", 8) + _layer("ra", "ReLU", ["fa"], ["fa"])
    + ip("fb", "fc1", "fb", 8) + _layer("rb", "ReLU", ["fb"], ["rb"])
    + ip("fc2", "fa", "fc2", 3) + ip("fc3", "rb", "fc3", 3)
)

CONV_FAN = (  # fan/join: Split + Eltwise; BatchNorm; Dropout in place; max and average pooling
    _input((2, 3, 8, 8), 2)
    + conv("conv1", "data", "conv1", 4) + _layer("relu1", "ReLU", ["conv1"], ["conv1"])
    + conv("conva", "conv1", "conva", 4) + _layer("relua", "ReLU", ["conva"], ["conva"])
    + _layer("poolb", "Pooling", ["conv1"], ["poolb"], "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    + conv("convb", "poolb", "convb", 4)
    + _layer("sum", "Eltwise", ["conva", "convb"], ["sum"])
    + _layer("bn", "BatchNorm", ["sum"], ["bn"])
    + _layer("relu2", "ReLU", ["bn"], ["bn"])
    + _layer("pool", "Pooling", ["bn"], ["pool"], "pooling_param { pool: AVE kernel_size: 2 stride: 2 }")
    + ip("fc1", "pool", "fc1", 10) + _layer("drop", "Dropout", ["fc1"], ["fc1"], "dropout_param { dropout_ratio: 0.3 }")
    + ip("fc2", "fc1", "fc2", 3)
    + _layer("loss", "SoftmaxWithLoss", ["fc2", "label"], ["loss"])
)

DENSE = (  # DenseNet-like full join: every block concatenates all earlier features
    _input((2, 3, 6, 6), 2)
    + conv("conv0", "data", "x0", 4)
    + _layer("bn1", "BatchNorm", ["x0"], ["n1"]) + _layer("r1", "ReLU", ["n1"], ["n1"]) + conv("c1", "n1", "b1", 3)
    + _layer("cat1", "Concat", ["x0", "b1"], ["x1"])
    + _layer("bn2", "BatchNorm", ["x1"], ["n2"]) + _layer("r2", "ReLU", ["n2"], ["n2"]) + conv("c2", "n2", "b2", 3)
    + _layer("cat2", "Concat", ["x1", "b2"], ["x2"])
    + _layer("r3", "ReLU", ["x2"], ["n3"]) + conv("c3", "n3", "b3", 3)
    + _layer("cat3", "Concat", ["x0", "x2", "b3"], ["x3"])
    + _layer("drop", "Dropout", ["x3"], ["x3d"], "dropout_param { dropout_ratio: 0.2 }")
    + _layer("pool", "Pooling", ["x3d"], ["pool"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + ip("fc", "pool", "fc", 3)
    + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
)


def _graph(text: str):
    return build_graph(text_format.Parse("name: \"t\"\n" + text, pb.NetParameter()), pb.TRAIN)


def _mlp_with_loss():
    return MLP_FAN + _layer("sum", "Eltwise", ["fc2", "fc3"], ["out"]) + _layer(
        "loss", "SoftmaxWithLoss", ["out", "label"], ["loss"])


def _param_bytes(net):
    return net.pool.used_bytes if net.memory.name == "baseline" else net.memory.param_bytes


def train(text: str, memory: str, iters: int = 3, pool_bytes=None, seed=7):
    net = Net(_graph(text), BACKEND, train=True, seed=seed, pool_bytes=pool_bytes, memory=memory)
    rng = np.random.default_rng(1)
    shape = net.data["data"].shape
    losses = []
    for it in range(iters):
        net.ctx.iteration = it
        net.data["data"].array[...] = rng.standard_normal(shape).astype(np.float32)
        net.data["label"].array[...] = rng.integers(0, 3, net.data["label"].shape).astype(np.float32)
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for decl in net.learnable:
            decl.data -= np.float32(0.1) * decl.diff  # plain SGD on the solver's list
    weights = [t.array.tobytes() for t in net.tensors if t.kind == "param"]
    return net, weights, losses


def _check_modes(text: str, tight: bool = True):
    _, ref, ref_losses = train(text, "baseline")
    for mode in ("liveness", "offload", "recompute", "auto"):
        net, got, losses = train(text, mode)
        assert losses == ref_losses, mode
        assert got == ref, f"{mode}: weights differ from baseline"
    if not tight:
        return
    # A pool between the offload plan and liveness's peak: offload must really move tensors.
    plan = make_plan(_graph(text), plan_backward=False)
    probe = Net(_graph(text), BACKEND, memory="liveness")
    params = probe.memory.param_bytes
    live_peak = plan.peak("liveness")[0]
    rec_peak = plan.peak("recompute")[0]
    for mode in ("offload", "recompute", "auto"):
        # One block below liveness's peak: something must leave the device (the plans need less).
        budget = params + live_peak - 1024 if mode != "auto" else params + rec_peak + 4096
        net, got, losses = train(text, mode, pool_bytes=budget)
        assert got == ref, f"{mode} in a {budget}-byte pool: weights differ from baseline"
        assert losses == ref_losses
        if mode == "offload" and budget < params + live_peak:
            mm = net.memory
            assert mm.bytes_offloaded > 0 and mm.hits > 0, "a pool below liveness's peak must offload"
            # Everything fetched back was copied out first; tensors that may have to leave are copied ahead
            # (overlapping compute), so some copies are never needed.
            assert 0 < mm.bytes_prefetched <= mm.bytes_offloaded
            assert max(mm.trace) <= budget - params


def test_mlp_fan_join_all_modes_identical():
    _check_modes(_mlp_with_loss(), tight=False)


def test_conv_fan_join_bn_dropout_all_modes_identical():
    _check_modes(CONV_FAN)


def test_densenet_like_full_join_all_modes_identical():
    # Default pool only: its tiny tensors fragment a pool one block under liveness's peak (see MEMORY.md).
    _check_modes(DENSE, tight=False)


@pytest.mark.parametrize("text", [CONV_FAN, DENSE], ids=["fan", "dense"])
def test_pool_usage_per_step_equals_plan_under_liveness(text):
    net, _, _ = train(text, "liveness", iters=2)
    plan = make_plan(_graph(text), plan_backward=False)
    assert net.memory.trace == plan.traces["liveness"].bytes
    assert max(net.memory.trace) < plan.traces["baseline"].bytes[0]


@pytest.mark.parametrize("text", [CONV_FAN, DENSE], ids=["fan", "dense"])
def test_recompute_pool_trace_equals_plan(text):
    net, _, _ = train(text, "recompute", iters=2)
    plan = make_plan(_graph(text), plan_backward=False)
    assert net.memory.replays == 2 * plan.schedules["recompute"].info["extra_forward_steps"] > 0  # 2 iterations
    # With room to spare nothing is offloaded: the pool holds exactly the plan's drops and replays
    # (transient replay tensors included), i.e. the recompute schedule without its host moves.
    sched = plan.schedules["recompute"]
    keep = lambda acts: [a for a in acts if a[0] not in (OFFLOAD, PREFETCH)]  # noqa: E731
    no_moves = Schedule([keep(a) for a in sched.before], [keep(a) for a in sched.after])
    assert net.memory.trace == simulate(plan.program, no_moves).bytes
    assert max(net.memory.trace) < plan.peak("liveness")[0]


def test_mlp_pool_trace_equals_plan():
    text = _mlp_with_loss()
    net, _, _ = train(text, "liveness", iters=2)
    assert net.memory.trace == make_plan(_graph(text), plan_backward=False).traces["liveness"].bytes


def test_pool_below_the_plan_is_refused_before_the_first_iteration(monkeypatch):
    # A plan is a promise: a pool the liveness plan does not fit (though max(l_i) would) is refused when the
    # Net is built, naming the step and the bytes, instead of running out in the middle of an iteration.
    monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "0")  # else the parameters would leave to make room
    text = _mlp_with_loss()
    plan = make_plan(_graph(text), plan_backward=False)
    probe = Net(_graph(text), BACKEND, memory="liveness")
    first_fwd = plan.traces["liveness"].bytes[0]
    budget = probe.memory.param_bytes + (first_fwd + plan.peak("liveness")[0]) // 2
    with pytest.raises(UserError) as e:
        Net(_graph(text), BACKEND, memory="liveness", pool_bytes=budget)
    msg = str(e.value)
    assert not isinstance(e.value, PoolExhausted)
    assert "cannot train this net under --memory liveness: its plan peaks at" in msg
    assert str(probe.memory.param_bytes + plan.peak("liveness")[0]) in msg  # the bytes the plan needs
    train(text, "liveness", pool_bytes=probe.memory.param_bytes + plan.peak("liveness")[0])  # and that is enough


def test_auto_picks_cheapest_mode_that_fits():
    text = _mlp_with_loss()
    assert Net(_graph(text), BACKEND, memory="auto").memory.name == "baseline"
    plan = make_plan(_graph(text), plan_backward=False)
    probe = Net(_graph(text), BACKEND, memory="liveness")
    net = Net(_graph(text), BACKEND, memory="auto",
              pool_bytes=probe.memory.param_bytes + plan.peak("liveness")[0] + 2048)
    assert net.memory.name == "liveness"
    # No mode fits beside resident parameters: auto streams them (the cheapest mode that fits so).
    net = Net(_graph(text), BACKEND, memory="auto", pool_bytes=probe.memory.param_bytes + 2048)
    assert net.memory.name in ("liveness", "offload", "recompute") and net.params.offloaded
    with pytest.raises(UserError, match="cannot hold even the recompute plan"):
        Net(_graph(text), BACKEND, memory="auto", pool_bytes=2048)


def test_freed_blob_read_says_so():
    net, _, _ = train(_mlp_with_loss(), "liveness", iters=1)
    assert np.isfinite(net.blob("loss")).all()  # outputs stay readable after the iteration
    with pytest.raises(UserError, match="not resident"):
        net.blob("fc1")


MINI_ALEX = (  # AlexNet's pattern in miniature: in-place ReLU after conv, LRN, max pool, in-place Dropout after FC
    _input((2, 3, 11, 11), 2)
    + conv("conv1", "data", "conv1", 4, k=3, pad=0) + _layer("relu1", "ReLU", ["conv1"], ["conv1"])
    + _layer("norm1", "LRN", ["conv1"], ["norm1"], "lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 }")
    + _layer("pool1", "Pooling", ["norm1"], ["pool1"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    + conv("conv2", "pool1", "conv2", 6) + _layer("relu2", "ReLU", ["conv2"], ["conv2"])
    + ip("fc6", "conv2", "fc6", 12) + _layer("relu6", "ReLU", ["fc6"], ["fc6"])
    + _layer("drop6", "Dropout", ["fc6"], ["fc6"], "dropout_param { dropout_ratio: 0.5 }")
    + ip("fc8", "fc6", "fc8", 3)
    + _layer("loss", "SoftmaxWithLoss", ["fc8", "label"], ["loss"])
)


def test_mini_alexnet_all_modes_identical():
    _check_modes(MINI_ALEX)


def test_forward_only_test_net_in_every_mode():
    values = {}
    for mode in ("baseline", "liveness", "offload", "recompute"):
        g = build_graph(text_format.Parse('name: "t"\n' + MINI_ALEX, pb.NetParameter()), pb.TEST)
        net = Net(g, BACKEND, train=False, seed=3, memory=mode)
        got = []
        for it in range(2):  # a second forward starts from the first one's leftovers
            rng = np.random.default_rng(it)
            net.data["data"].array[...] = rng.standard_normal(net.data["data"].shape).astype(np.float32)
            net.data["label"].array[...] = 1
            got.append((net.forward(), net.blob("loss").tobytes()))
        values[mode] = got
    assert all(v == values["baseline"] for v in values.values())


CHAIN = (
    _layer("data", "Input", [], ["data", "label"],
           'input_param { shape { dim: 4 dim: 3 dim: 12 dim: 12 } shape { dim: 4 } }')
    + _layer("conv1", "Convolution", ["data"], ["conv1"],
             'convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } }')
    + _layer("pool1", "Pooling", ["conv1"], ["pool1"], "pooling_param { pool: AVE kernel_size: 2 stride: 2 }")
    + _layer("relu1", "ReLU", ["pool1"], ["pool1"])
    + _layer("conv2", "Convolution", ["pool1"], ["conv2"],
             'convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "xavier" } }')
    + _layer("bn2", "BatchNorm", ["conv2"], ["conv2"])
    + _layer("scale2", "Scale", ["conv2"], ["conv2"], "scale_param { bias_term: true }")
    + _layer("relu2", "ReLU", ["conv2"], ["conv2"])
    + _layer("pool2", "Pooling", ["conv2"], ["pool2"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + _layer("sig", "Sigmoid", ["pool2"], ["sig"])
    + _layer("fc", "InnerProduct", ["sig"], ["fc"], 'inner_product_param { num_output: 3 weight_filler { type: "xavier" } }')
    + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
)


def test_multi_layer_segments_replay_from_live_inputs():
    # Segments of several non-checkpoint layers (AVE pool -> in-place ReLU; in-place BN -> Scale -> ReLU -> pool
    # -> Sigmoid): a replay must start from tensors that are still (or again) on the device.
    # Default pool: a pool one block under liveness's peak fragments on these tiny tensors (see MEMORY.md).
    _check_modes(CHAIN, tight=False)


def test_pool_exhaustion_injected_mid_iteration_keeps_the_snapshots(tmp_path, monkeypatch):
    # A fault in the 5th iteration of a run that snapshots every 2: a clear error, and the iteration-4
    # snapshot is intact -- it resumes to exactly the weights of a clean 4-iteration run.
    from test_solver import Quiet, make_solver, solver_param

    from superneurons.solver import Solver
    from superneurons.solver.snapshot import snapshot_paths

    monkeypatch.chdir(tmp_path)
    text = 'base_lr: 0.1 momentum: 0.9 max_iter: 6 snapshot: 2 snapshot_prefix: "snap/f" random_seed: 5'
    solver = Solver(solver_param(text), "test_solver.prototxt", memory="liveness", log=Quiet())
    pool = solver.net.pool
    real_alloc = pool.alloc

    def faulty_alloc(key, nbytes):
        if solver.iter == 4 and not str(key).endswith("@diff"):
            raise PoolExhausted(f"memory pool exhausted: need {nbytes} bytes for {key!r} (injected fault)")
        return real_alloc(key, nbytes)

    monkeypatch.setattr(pool, "alloc", faulty_alloc)
    with pytest.raises(PoolExhausted) as e:
        solver.solve()
    assert isinstance(e.value, UserError) and "injected fault" in str(e.value) and "under --memory liveness" in str(e.value)
    assert solver.iter == 4
    _, state = snapshot_paths(solver.prefix, 4, False)
    clean = make_solver(text.replace("max_iter: 6", "max_iter: 4"))
    clean.solve()
    resumed = make_solver(text)
    resumed.restore(state)
    assert resumed.iter == 4
    for a, b in zip(resumed.net.learnable, clean.net.learnable):
        assert a.data.tobytes() == b.data.tobytes()


# Slice, PReLU, ELU, Deconvolution, Crop, MVN, Reshape, Bias, EuclideanLoss, Embed, Reduction, ArgMax and Silence
# in one float32 net: every memory mode gives baseline's loss and gradients.
ZOO_LAYERS_NET = """
layer { name: 'in' type: 'Input' top: 'x' top: 'target' top: 'ids'
        input_param { shape { dim: 4 dim: 6 dim: 3 dim: 3 } shape { dim: 4 dim: 72 } shape { dim: 4 dim: 2 } } }
layer { name: 'slice' type: 'Slice' bottom: 'x' top: 'a' top: 'b' slice_param { slice_point: 2 } }
layer { name: 'prelu' type: 'PReLU' bottom: 'a' top: 'a' }
layer { name: 'elu' type: 'ELU' bottom: 'b' top: 'b' }
layer { name: 'deconv' type: 'Deconvolution' bottom: 'b' top: 'up'
        convolution_param { num_output: 2 kernel_size: 2 stride: 2 weight_filler { type: 'gaussian' std: 0.3 } } }
layer { name: 'crop' type: 'Crop' bottom: 'up' bottom: 'a' top: 'upc' crop_param { offset: 1 } }
layer { name: 'cat' type: 'Concat' bottom: 'a' bottom: 'upc' bottom: 'b' top: 'cat' }
layer { name: 'mvn' type: 'MVN' bottom: 'cat' top: 'cat' }
layer { name: 'flat' type: 'Reshape' bottom: 'cat' top: 'flat' reshape_param { shape { dim: 0 dim: -1 } } }
layer { name: 'bias' type: 'Bias' bottom: 'flat' top: 'flat' bias_param { filler { type: 'gaussian' } } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'flat' bottom: 'target' top: 'loss' }
layer { name: 'emb' type: 'Embed' bottom: 'ids' top: 'e' embed_param { num_output: 3 input_dim: 7 } }
layer { name: 'red' type: 'Reduction' bottom: 'e' top: 'r' reduction_param { operation: SUMSQ } loss_weight: 0.1 }
layer { name: 'am' type: 'ArgMax' bottom: 'x' top: 'am' }
layer { name: 'sil' type: 'Silence' bottom: 'am' }
"""


@pytest.mark.parametrize("memory", ["baseline", "liveness", "recompute"])
def test_new_layers_train_together_in_float32_under_memory_modes(memory):
    rng = np.random.default_rng(123)
    inputs = {"x": rng.standard_normal((4, 6, 3, 3)), "target": rng.standard_normal((4, 72)),
              "ids": rng.integers(0, 7, (4, 2)).astype(np.float64)}
    results = []
    for mode in ("baseline", memory):
        net = Net(build_graph(text_format.Parse(ZOO_LAYERS_NET, pb.NetParameter()), pb.TRAIN), CpuBackend(), seed=7,
                  memory=mode)
        for k, v in inputs.items():
            net.data[k].array[...] = v
        loss = net.forward()
        net.backward()
        grads = [np.array(d.diff, copy=True) for n in net.graph.nodes for d in net.layer(n.name).params]
        results.append((loss, grads))
    (loss0, g0), (loss1, g1) = results
    assert np.isfinite(loss0) and loss0 > 0
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        assert a.dtype == np.float32 and np.isfinite(a).all()
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
