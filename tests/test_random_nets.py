"""A plan is a promise: on random nets and on the graph shapes that once broke it, every memory mode's pool
holds what `superneurons memory` plans, step by step, trains in a pool of the planned peak to baseline's
weights, and refuses a smaller pool before the first iteration rather than running out in the middle.

`RANDOM_NETS=500 pytest tests/test_random_nets.py` checks more nets (default 40, about 10 s; on a GPU,
`RANDOM_NETS_GPU`, default 12);
`python tests/random_nets.py --nets 500` does the same with a summary (docs/MEMORY.md has the numbers).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from random_nets import CLASSES, PRECISIONS, RandomNet, build, check_net, random_net, sweep_net, train
from superneurons.backend.cuda.probe import gpu_available
from superneurons.errors import PoolExhausted, UserError
from superneurons.memory.plan import make_plan

NETS = int(os.environ.get("RANDOM_NETS", "40"))
SWEPT = int(os.environ.get("RANDOM_NETS_SWEPT", "4"))  # nets swept over budgets (tools/fuzz's `budget` kind: more)
GPU_NETS = int(os.environ.get("RANDOM_NETS_GPU", "12"))


@pytest.mark.parametrize("seed", range(NETS))
def test_random_net_keeps_the_plan(seed):
    problems = check_net(random_net(seed))
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("seed", range(GPU_NETS))
def test_random_net_keeps_the_plan_on_the_gpu(gpu, seed):
    # The same promise on the GPU; weights within 1e-3 of baseline's (convolution algorithms follow the
    # workspace each pool has free, so the bits may differ), pools of exactly the plan included.
    problems = check_net(random_net(seed), backend=gpu, rtol=1e-3)
    assert not problems, "\n".join(problems)


def test_generator_is_seeded_and_covers_the_graph_shapes():
    assert random_net(5).text == random_net(5).text
    seen = set()
    for seed in range(60):
        seen.update(random_net(seed).features)
    for feature in ("Convolution", "Deconvolution", "Pooling MAX", "Pooling AVE", "InnerProduct", "ReLU", "BatchNorm",
                    "Scale", "Eltwise SUM", "Eltwise PROD", "Eltwise MAX", "Concat", "Slice", "Dropout", "LRN",
                    "Flatten", "Reshape", "Softmax", "SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss",
                    "fan-out", "in place", "repeated bottom", "shared weights", "several losses", "propagate_down"):
        assert feature in seen, feature


def test_check_net_finds_a_broken_promise(monkeypatch):
    # The check itself can fail: a manager that keeps gradients past the plan's free is reported.
    from superneurons.memory.liveness_manager import LivenessManager

    real = LivenessManager._free
    monkeypatch.setattr(LivenessManager, "_free", lambda self, k: None if k.endswith("@diff") else real(self, k))
    problems = check_net(FAN_JOIN_TWICE, modes=("baseline", "liveness"))
    assert any(p.startswith("liveness default pool trace") for p in problems), problems


# -- regression nets: each graph shape that broke the promise, written out ------------------------------------

def _net(name: str, body: str, c: int = 2, h: int = 6) -> RandomNet:
    head = (f'name: "{name}"\nlayer {{ name: "input" type: "Input" top: "data" top: "label" input_param {{ '
            f'shape {{ dim: 2 dim: {c} dim: {h} dim: {h} }} shape {{ dim: 2 }} }} }}\n')
    return RandomNet(1, head + body, body.count("layer"))


W = 'weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 }'


def _conv(name, bottom, top, n=3, k=3):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
            f'convolution_param {{ num_output: {n} kernel_size: {k} pad: {k // 2} {W} }} }}\n')


def _ip(name, bottom, top, n=CLASSES):
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{top}" '
            f'inner_product_param {{ num_output: {n} {W} }} }}\n')


def _l(name, type_, bottoms, tops, extra=""):
    b = "".join(f' bottom: "{x}"' for x in bottoms)
    t = "".join(f' top: "{x}"' for x in tops)
    return f'layer {{ name: "{name}" type: "{type_}"{b}{t} {extra} }}\n'


# The shape that breaks planners: fan-out, joins, a blob used twice by one layer, pooling backward, parameter gradients,
# several losses (so backward starts with more than one seeded gradient while replays run).
FAN_JOIN_TWICE = _net("fan_join_twice", (
    _conv("conv1", "data", "c1") + _l("relu1", "ReLU", ["c1"], ["c1"])
    + _conv("conv2", "c1", "c2")
    + _l("twice", "Eltwise", ["c2", "c2"], ["tw"])
    + _l("pool1", "Pooling", ["c1"], ["p1"], "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    + _l("join", "Eltwise", ["tw", "p1"], ["j"])
    + _l("pool2", "Pooling", ["j"], ["p2"], "pooling_param { pool: AVE kernel_size: 2 stride: 2 }")
    + _ip("fc", "p2", "fc") + _l("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
    + _ip("fc2", "c1", "fc2") + _l("loss2", "SoftmaxWithLoss", ["fc2", "label"], ["loss2"], "loss_weight: 0.5")))

# Recompute replays at the first backward step while the losses' gradients are already seeded: the plan
# counted them only after the replays (they are filled before any hook of that step runs).
SEEDS_DURING_REPLAY = _net("seeds_during_replay", (
    _l("sig", "Sigmoid", ["data"], ["data"])
    + _l("pool1", "Pooling", ["data"], ["p1"], "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    + _l("bn1", "BatchNorm", ["p1"], ["p1"])
    + _l("bn2", "BatchNorm", ["data"], ["bn2"])
    + _l("scale2", "Scale", ["bn2"], ["bn2"], "scale_param { bias_term: true }")
    + _l("relu2", "ReLU", ["bn2"], ["bn2"])
    + _l("pool2", "Pooling", ["bn2"], ["p2"], "pooling_param { pool: AVE kernel_size: 3 stride: 1 pad: 1 }")
    + _l("relu3", "ReLU", ["p1"], ["r3"])
    + f'layer {{ name: "deconv" type: "Deconvolution" bottom: "r3" top: "dc" '
      f'convolution_param {{ num_output: 2 kernel_size: 3 pad: 1 {W} }} }}\n'
    + _l("twice", "Eltwise", ["p2", "p2"], ["tw"], "propagate_down: true propagate_down: false")
    + _ip("fc", "tw", "fc") + _l("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
    + _l("loss2", "SigmoidCrossEntropyLoss", ["dc", "data"], ["loss2"], "propagate_down: true propagate_down: false")))

# softmax(pool(conv)) both dropped: rebuilding the softmax for its own backward replays the pooling, which
# needs the convolution's output long after the pooling's last use (it was allocated empty, not fetched).
CHAINED_REPLAY = _net("chained_replay", (
    _l("bn", "BatchNorm", ["data"], ["bn"]) + _l("scale", "Scale", ["bn"], ["bn"], "scale_param { bias_term: true }")
    + _l("relu", "ReLU", ["bn"], ["bn"])
    + f'layer {{ name: "conv1" type: "Convolution" bottom: "bn" top: "c1" '
      f'convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 stride: 2 {W} }} }}\n'
    + _l("pool", "Pooling", ["c1"], ["p"], "pooling_param { pool: AVE kernel_size: 3 stride: 1 pad: 1 }")
    + _l("softmax", "Softmax", ["p"], ["sm"])
    + _l("drop", "Dropout", ["sm"], ["dr"], "dropout_param { dropout_ratio: 0.3 }")
    + _conv("conv2", "sm", "c2", 1, 1) + _l("sum", "Eltwise", ["p", "c1"], ["s"]) + _l("relu2", "ReLU", ["s"], ["s"])
    + _conv("conv3", "c1", "c3", 2) + _conv("conv4", "c2", "c4", 2, 1)
    + _ip("fa", "c4", "fa") + _l("la", "SoftmaxWithLoss", ["fa", "label"], ["la"])
    + _ip("fb", "dr", "fb") + _l("lb", "SoftmaxWithLoss", ["fb", "label"], ["lb"])
    + _ip("fc", "c3", "fc") + _l("lc", "SoftmaxWithLoss", ["fc", "label"], ["lc"])), c=1, h=8)

# A TanH in place on a Flatten view rewrites the convolution output after an LRN read it: a replay of the
# LRN in backward would read the rewritten value.
IN_PLACE_ON_A_VIEW = _net("in_place_on_a_view", (
    _conv("conv1", "data", "c1")
    + _l("lrn", "LRN", ["c1"], ["lrn"], "lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 }")
    + _l("prod", "Eltwise", ["lrn", "c1"], ["prod"], "eltwise_param { operation: PROD }")
    + _l("flat", "Flatten", ["c1"], ["flat"]) + _l("tanh", "TanH", ["flat"], ["flat"])
    + _l("loss", "EuclideanLoss", ["prod", "c1"], ["loss"], "propagate_down: true propagate_down: false")
    + _ip("fc", "flat", "fc") + _l("loss2", "SoftmaxWithLoss", ["fc", "label"], ["loss2"])))

# Streamed parameters: BatchNorm's statistics have gradients the runtime brings in for backward, and a replay
# brings in the replayed layer's weights; the plan's streamed peak counted neither.
STREAMED_BN_REPLAY = _net("streamed_bn_replay", (
    _conv("conv1", "data", "c1") + _l("bn", "BatchNorm", ["c1"], ["bn"])
    + _ip("fa", "bn", "fa", 6) + _l("ra", "Sigmoid", ["fa"], ["fa"]) + _ip("fb", "fa", "fb")
    + _l("loss", "SoftmaxWithLoss", ["fb", "label"], ["loss"])
    + _l("loss2", "EuclideanLoss", ["bn", "c1"], ["loss2"], "propagate_down: true propagate_down: false")))

# Recompute with block checkpoints: Scale in place after BatchNorm keeps a copy of its input; rebuilding it
# replays the BatchNorm, whose input (a Dropout of an Eltwise checkpoint) must still be rebuildable then.
IN_PLACE_REPLAY_CHAIN = _net("in_place_replay_chain", (
    _l("twice", "Eltwise", ["data", "data"], ["e1"])
    + _l("drop", "Dropout", ["e1"], ["d"], "dropout_param { dropout_ratio: 0.3 }")
    + _l("pool", "Pooling", ["d"], ["p"], "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    + _l("bn", "BatchNorm", ["d"], ["bn"]) + _l("scale", "Scale", ["bn"], ["bn"], "scale_param { bias_term: true }")
    + _l("join", "Eltwise", ["bn", "e1"], ["j"], "eltwise_param { operation: SUM coeff: 1 coeff: -0.5 }")
    + _l("relu", "ReLU", ["j"], ["r"]) + _l("again", "Eltwise", ["j", "j"], ["j2"])
    + _l("loss", "EuclideanLoss", ["r", "p"], ["loss"]) + _l("loss2", "EuclideanLoss", ["j2", "j2"], ["loss2"])),
    c=3, h=8)

# A Split's gradient memory must be one that a consumer rewrites every pass: a Reshape writes nothing itself,
# and the loss after it had propagate_down: false, so the sum accumulated over iterations in baseline.
RESHAPE_NOT_REWRITTEN = _net("reshape_not_rewritten", (
    _conv("conv1", "data", "c1", 2)
    + _l("bn", "BatchNorm", ["c1"], ["bn"])
    + _l("loss", "EuclideanLoss", ["bn", "data"], ["loss"], "propagate_down: true propagate_down: false")
    + _conv("conv2", "data", "c2", 2)
    + _l("flat2", "Reshape", ["c2"], ["f2"], "reshape_param { shape { dim: 0 dim: -1 } }")
    + _l("flat1", "Reshape", ["c1"], ["f1"], "reshape_param { shape { dim: 0 dim: -1 } }")
    + _l("loss2", "EuclideanLoss", ["f2", "f1"], ["loss2"], "propagate_down: true propagate_down: false")))

REGRESSIONS = [FAN_JOIN_TWICE, SEEDS_DURING_REPLAY, CHAINED_REPLAY, IN_PLACE_ON_A_VIEW, STREAMED_BN_REPLAY,
               IN_PLACE_REPLAY_CHAIN, RESHAPE_NOT_REWRITTEN]


@pytest.mark.parametrize("net", REGRESSIONS, ids=lambda n: n.text.split('"')[1])
def test_graph_shape_keeps_the_plan(net):
    problems = check_net(net)
    assert not problems, "\n".join(problems)


def test_seeded_gradients_count_during_first_backward_replays():
    plan = make_plan(SEEDS_DURING_REPLAY.graph(), plan_backward=False)
    first = plan.schedules["recompute"].before[plan.program.n_forward]
    seeds = set(plan.program.seeds)
    assert len(seeds) == 2 and any(op == "run" for op, _ in first)
    assert {k for _op, k in first[:len(seeds)]} == seeds  # before any prefetch or replay


def test_replayed_inputs_stay_until_dependent_replays():
    plan = make_plan(CHAINED_REPLAY.graph(), plan_backward=False)
    sched = plan.schedules["recompute"]
    # The convolution output is never allocated empty for a replay: it is on the device or fetched back.
    runs_from_scratch = [(s, k) for s, acts in enumerate(sched.before) for op, k in acts
                         if op == "alloc" and k == "c1" and s >= plan.program.n_forward]
    assert runs_from_scratch == []
    # The pooling would need it until the softmax's backward, long after the convolution's last use: neither
    # is dropped (the old plan dropped both and replayed the pooling from an empty block).
    assert "p" not in sched.info["dropped"] and "sm" not in sched.info["dropped"]


def test_in_place_rewritten_input_is_not_replayed():
    sched = make_plan(IN_PLACE_ON_A_VIEW.graph(), plan_backward=False).schedules["recompute"]
    assert "lrn" not in sched.info["dropped"]


def test_streamed_peak_counts_statistics_gradients_and_replay_weights():
    plan = make_plan(STREAMED_BN_REPLAY.graph(), plan_backward=False)
    steps = plan.program.steps
    bn_back = next(s.index for s in steps if s.node.name == "bn" and s.phase == "backward")
    # mean, variance, scale factor and their gradients, one block each
    assert plan.param_window[bn_back] == 6 * 1024
    runtime = build(STREAMED_BN_REPLAY, "recompute", plan.streamed_peak("recompute"), stream=True)
    assert runtime.params.offloaded
    train(runtime)  # fits exactly


def test_too_small_a_pool_is_refused_before_the_first_iteration():
    net = FAN_JOIN_TWICE
    plan = make_plan(net.graph(), plan_backward=False)
    params = build(net, "liveness").memory.param_bytes
    for mode in ("liveness", "offload", "recompute"):
        budget = params + plan.peak(mode)[0] - 1024
        with pytest.raises(UserError, match=f"cannot train this net under --memory {mode}: its plan peaks") as e:
            build(net, mode, budget, stream=False)
        assert not isinstance(e.value, PoolExhausted)
        assert str(params + plan.peak(mode)[0]) in str(e.value)  # the bytes the plan needs
        runtime = build(net, mode, budget + 1024, stream=False)
        weights, losses, _ = train(runtime)
        assert np.isfinite(losses).all()


# Convolutions, LRN, Concat, Eltwise and a wide InnerProduct: with the parameters streamed, the momentum
# update of ip1 (weights, gradient, history) needs more than any step, so a plan without the update let a
# run start and fail at the end of its first iteration.
WIDE_INNER_PRODUCT = _net("wide_inner_product", (
    _conv("conv1", "data", "conv1", n=4) + _l("relu1", "ReLU", ["conv1"], ["conv1"])
    + _l("norm1", "LRN", ["conv1"], ["norm1"], "lrn_param { local_size: 3 }")
    + _conv("conv2a", "norm1", "conv2a", n=2) + _conv("conv2b", "norm1", "conv2b", n=2, k=1)
    + _l("cat", "Concat", ["conv2a", "conv2b"], ["cat"]) + _l("sum", "Eltwise", ["cat", "conv1"], ["sum"])
    + _ip("ip1", "sum", "ip1", n=64) + _ip("ip2", "ip1", "ip2")
    + _l("loss", "SoftmaxWithLoss", ["ip2", "label"], ["loss"])), c=3, h=8)


@pytest.mark.parametrize("net, precision", [(WIDE_INNER_PRODUCT, p) for p in PRECISIONS]
                         + [(random_net(seed), PRECISIONS[seed % 3]) for seed in range(SWEPT)]
                         # no convolution: auto must weigh the default checkpoints --memory recompute runs
                         + [(random_net(20067), "FLOAT")],
                         ids=lambda x: x if isinstance(x, str) else x.text.split('"')[1])
def test_every_budget_is_refused_at_setup_or_trains(net, precision):
    # The Solver's own momentum update, every mode, budgets from the smallest plan to baseline's and around
    # each mode's need: below the need the Solver is refused when built, at it the run trains to the end.
    tally = {}
    problems = sweep_net(net, tally=tally, precision=precision)
    assert not problems, "\n".join(problems)
    assert tally.get(("recompute", "refused at setup")) and tally.get(("recompute", "trained"))
