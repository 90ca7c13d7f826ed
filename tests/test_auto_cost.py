"""`--memory auto` weighs time across modes and checkpoint sets (memory/cost.py): where offloading every
convolution output would keep the host link busy, it recomputes from block boundaries instead; explicit
checkpoint types are respected; the choice reaches the Net's manager and trains exactly like baseline."""
from __future__ import annotations

import json

import pytest
from google.protobuf import text_format

from superneurons.cli import main
from superneurons.errors import UserError
from superneurons.graph.batch import set_batch
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net
from superneurons.memory import BLOCK_CHECKPOINTS, checkpoint_sets, resolve_memory
from superneurons.memory.cost import DEVICE_BW, FITS_ANYWAY, FLOPS, choose, estimate, forward_seconds
from superneurons.memory.offload import DEFAULT_CHECKPOINTS
from superneurons.memory.plan import make_plan, offloaded_bytes, replay_count
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

from test_memory_modes import BACKEND, MLP_FAN, _graph, train
from test_recompute_resnet import RESNET

RESNET50 = "models/resnet50/resnet50_dummy.prototxt"


def _plans(graph, params: int) -> dict:
    """Every candidate checkpoint set's full plan, with the Net's resident parameter bytes."""
    plans = {}
    for types in checkpoint_sets(graph):
        plans[types] = make_plan(graph, plan_backward=False, checkpoint_types=types)
        plans[types].param_bytes = params
    return plans


def _tiny_budgets() -> tuple[int, dict]:
    """RESNET's resident parameter bytes and its plans per checkpoint set."""
    params = Net(_graph(RESNET), BACKEND, memory="liveness").memory.param_bytes
    return params, _plans(_graph(RESNET), params)


def test_conv_flops_respect_groups():
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 8 dim: 5 dim: 5 } } }\n'
            'layer { name: "c" type: "Convolution" bottom: "x" top: "y" '
            'convolution_param { num_output: 4 kernel_size: 3 group: 2 } }\n'
            'layer { name: "fc" type: "InnerProduct" bottom: "y" top: "z" inner_product_param { num_output: 3 } }\n')
    graph = build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)
    conv, fc = graph.nodes[1], graph.nodes[2]
    # 2 images x 3x3 outputs x 4 filters, each over 8/2 channels x 3x3 taps; a multiply-add is 2 FLOPs
    assert conv.layer.forward_flops() == 2 * (2 * 3 * 3 * 4 * (8 // 2) * 3 * 3)
    assert fc.layer.forward_flops() == 2 * (2 * (4 * 3 * 3) * 3)
    assert graph.nodes[0].layer.forward_flops() == 0


def test_cost_model_reads_what_each_layer_declares():
    """A step costs the longer of its layer's declared FLOPs and bytes; a layer that declares more compute
    costs more without the cost model knowing its type. Views and fused-away layers cost nothing."""
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 8 dim: 5 dim: 5 } } }\n'
            'layer { name: "bn" type: "BatchNorm" bottom: "x" top: "b" }\n'
            'layer { name: "sc" type: "Scale" bottom: "b" top: "b" scale_param { bias_term: true } }\n'
            'layer { name: "r" type: "ReLU" bottom: "b" top: "b" }\n'
            'layer { name: "fl" type: "Flatten" bottom: "b" top: "f" }\n'
            'layer { name: "fc" type: "InnerProduct" bottom: "f" top: "z" inner_product_param { num_output: 3 } }\n')
    graph = build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)
    n = 2 * 8 * 5 * 5
    bn = graph.node("bn")
    assert bn.layer.forward_bytes([(2, 8, 5, 5)], bn.top_shapes) == 4 * 2 * n
    assert forward_seconds(bn, graph) == 4 * 2 * n / DEVICE_BW  # element-wise: its bytes
    for name in ("sc", "r", "fl"):  # fused into the BatchNorm; a view of its bottom
        assert forward_seconds(graph.node(name), graph) == 0.0, name
    fc = graph.node("fc")
    assert forward_seconds(fc, graph) == max(fc.layer.forward_flops() / FLOPS, 4 * (n + 2 * 3) / DEVICE_BW)
    fc.layer.forward_flops = lambda: 10 ** 15  # as a new layer with heavy compute would declare
    assert forward_seconds(fc, graph) == 10 ** 15 / FLOPS


def test_conv_offload_that_would_move_lots_ranks_below_block_recompute():
    # ResNet-50 at a small batch, in a pool between the CONV offload plan and liveness's peak: the shape of
    # the measured H100 run (batch 344 in 12 GiB), where offload was transfer-bound at half the speed.
    net = read_net(RESNET50)
    set_batch(net, 8)
    graph = build_graph(net, pb.TRAIN)
    full = make_plan(graph, checkpoint_types=DEFAULT_CHECKPOINTS, solver_history=1)
    budget = full.param_bytes + (full.peak("offload")[0] + full.peak("liveness")[0]) // 2
    assert not full.fits("liveness", budget) and full.fits("offload", budget)
    calls = []

    def plan_for(types, modes, recompute_limit=0):
        if not recompute_limit:
            calls.append((types, tuple(modes)))
        if types == DEFAULT_CHECKPOINTS and not recompute_limit:
            return full
        return make_plan(graph, checkpoint_types=types, modes=modes, solver_history=1, recompute_limit=recompute_limit)

    choice = choose(budget, checkpoint_sets(graph), plan_for)
    assert calls == [(DEFAULT_CHECKPOINTS, FITS_ANYWAY), (DEFAULT_CHECKPOINTS, ("offload", "recompute")),
                     (BLOCK_CHECKPOINTS, ("offload", "recompute"))]
    assert (choice.mode, choice.checkpoint_types) == ("recompute", BLOCK_CHECKPOINTS)
    # The candidates that recompute down to max(l_i) (higher replay limits: the tests below).
    by = {(e.mode, e.checkpoint_types): e for e in choice.candidates if not e.recompute_limit}
    conv_offload, block = by["offload", DEFAULT_CHECKPOINTS], by["recompute", BLOCK_CHECKPOINTS]
    assert conv_offload.transfer_s > conv_offload.compute_s  # transfer-bound
    assert conv_offload.moved_bytes > 4 * block.moved_bytes
    assert block.replays > 0 and block.replay_s > 0  # block-boundary recompute pays in replays...
    assert block.seconds < conv_offload.seconds  # ...and still wins
    assert block.compute_s == conv_offload.compute_s  # the same net's forward and backward
    # The transfer term is the plan's checkpoint bytes beyond what fits beside its peak, out and back.
    spare = budget - full.peak("offload")[0] - full.param_bytes
    assert conv_offload.moved_bytes == 2 * (offloaded_bytes(full, "offload") - spare)


def test_a_higher_replay_limit_replays_each_segment_once_where_it_fits():
    """Recomputing down to max(l_i) replays the widest segments step by step (memory-centric); a plan
    allowed more bytes per step keeps them speed-centric (one replay per segment) and replays fewer steps.
    (The limit steers the strategies; whether the plan fits a budget is its peak's business, which auto checks.)"""
    net = read_net(RESNET50)
    set_batch(net, 8)
    graph = build_graph(net, pb.TRAIN)
    floor = make_plan(graph, checkpoint_types=BLOCK_CHECKPOINTS, modes=("recompute",))
    assert "memory" in floor.schedules["recompute"].info["strategies"].values()
    replays = [replay_count(floor.schedules["recompute"])]
    for limit in (floor.max_layer[1] * 3 // 2, floor.max_layer[1] * 4):
        plan = make_plan(graph, checkpoint_types=BLOCK_CHECKPOINTS, modes=("recompute",), recompute_limit=limit)
        assert plan.recompute_limit == limit
        replays.append(replay_count(plan.schedules["recompute"]))
    assert replays[0] > replays[1] >= replays[2]
    assert set(plan.schedules["recompute"].info["strategies"].values()) == {"speed"}
    # A limit below max(l_i) is the floor's plan.
    low = make_plan(graph, checkpoint_types=BLOCK_CHECKPOINTS, modes=("recompute",), recompute_limit=1024)
    assert low.schedules["recompute"].before == floor.schedules["recompute"].before


def test_auto_weighs_replay_limits_and_the_manager_runs_the_chosen_one():
    """With room beside the block checkpoints, auto picks a replay limit above max(l_i): the manager plans
    with it, replays fewer steps than the floor's plan, stays within the pool and trains like baseline."""
    params, plans = _tiny_budgets()
    conv, block = plans[DEFAULT_CHECKPOINTS], plans[BLOCK_CHECKPOINTS]
    low, high = params + block.peak("recompute")[0], params + conv.peak("liveness")[0]
    budget = low + (high - low) * 9 // 10  # recompute still needed, with room to keep replayed segments
    _, ref, ref_losses = train(RESNET, "baseline")
    net, got, losses = train(RESNET, "auto", pool_bytes=budget)
    choice = net.memory.auto
    assert (net.memory.name, net.checkpoint_types) == ("recompute", BLOCK_CHECKPOINTS)
    assert choice.recompute_limit > block.max_layer[1] and net.memory.recompute_limit == choice.recompute_limit
    assert net.memory.plan.recompute_limit == choice.recompute_limit  # the schedule the manager runs
    assert {e.recompute_limit for e in choice.candidates if e.mode == "recompute"} >= {0, choice.recompute_limit}
    assert choice.chosen.replays < replay_count(block.schedules["recompute"])
    assert choice.chosen.seconds < min(e.seconds for e in choice.candidates if e.mode == "recompute"
                                       and e.checkpoint_types == BLOCK_CHECKPOINTS and not e.recompute_limit)
    assert got == ref and losses == ref_losses
    assert max(net.memory.trace) + params <= budget


def test_cli_names_the_chosen_types_and_the_candidates(capsys):
    net = read_net(RESNET50)
    set_batch(net, 8)
    full = make_plan(build_graph(net, pb.TRAIN), solver_history=1)
    budget = full.param_bytes + (full.peak("offload")[0] + full.peak("liveness")[0]) // 2
    assert main(["memory", "--model", RESNET50, "--batch", "8", "--gpu-memory", str(budget)]) == 0
    out = capsys.readouterr().out
    assert ": recompute (checkpoints: Eltwise, Concat, Pooling)" in out
    table = out[out.index("candidates that fit"):].splitlines()
    assert any(r.startswith("offload") and "Convolution" in r for r in table)
    assert sum("<- auto" in r for r in table) == 1
    assert main(["memory", "--model", RESNET50, "--batch", "8", "--gpu-memory", str(budget), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["auto"] == "recompute" and doc["auto_streams_params"] is False and doc["budget_bytes"] == budget
    assert doc["auto_checkpoint_types"] == list(BLOCK_CHECKPOINTS)
    chosen = [c for c in doc["auto_candidates"] if c["mode"] == "recompute"
              and c["checkpoint_types"] == list(BLOCK_CHECKPOINTS) and c["recompute_limit"] == doc["auto_recompute_limit"]]
    assert len(chosen) == 1 and {c["recompute_limit"] for c in doc["auto_candidates"]} >= {0}
    assert doc["checkpoint_types"] == list(DEFAULT_CHECKPOINTS)  # the plan shown, as before
    assert {(c["mode"], tuple(c["checkpoint_types"])) for c in doc["auto_candidates"]} >= {
        ("offload", DEFAULT_CHECKPOINTS), ("recompute", BLOCK_CHECKPOINTS)}
    # Explicit types: only those are weighed.
    assert main(["memory", "--model", RESNET50, "--batch", "8", "--gpu-memory", str(budget), "--json",
                 "--checkpoints", "Convolution"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {tuple(c["checkpoint_types"]) for c in doc["auto_candidates"]} == {DEFAULT_CHECKPOINTS}
    assert doc["auto_checkpoint_types"] == list(DEFAULT_CHECKPOINTS)
    # When baseline fits, nothing else is weighed.
    assert main(["memory", "--model", RESNET50, "--batch", "8", "--gpu-memory", "64G", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["auto"] == "baseline" and doc["auto_candidates"] == []


def test_candidate_sets_name_layers_of_the_net():
    assert checkpoint_sets(_graph(RESNET)) == [DEFAULT_CHECKPOINTS, BLOCK_CHECKPOINTS]
    assert checkpoint_sets(_graph(MLP_FAN)) == [DEFAULT_CHECKPOINTS]  # no convolution, no block boundary
    assert checkpoint_sets(_graph(RESNET), ["Pooling"]) == [("Pooling",)]
    assert resolve_memory(None, None, unset_types=True) == ("auto", None, None)
    assert resolve_memory(None, pb.MemoryParameter(checkpoint_type=["Concat"]), unset_types=True)[1] == ("Concat",)


@pytest.mark.parametrize("where", ["tight", "offload fits"])
def test_auto_picked_block_recompute_reaches_the_manager_and_trains_like_baseline(where):
    params, plans = _tiny_budgets()
    conv, block = plans[DEFAULT_CHECKPOINTS], plans[BLOCK_CHECKPOINTS]
    # "tight": only the recompute plans fit, and block recompute must move some of its checkpoints;
    # "offload fits": CONV offload fits too, but would move more than twice the bytes block recompute moves.
    budget = params + (block.peak("recompute")[0] if where == "tight" else conv.peak("offload")[0] + 1024)
    assert not conv.fits("liveness", budget) and block.fits("recompute", budget)
    _, ref, ref_losses = train(RESNET, "baseline")
    net, got, losses = train(RESNET, "auto", pool_bytes=budget)
    assert (net.memory.name, net.checkpoint_types) == ("recompute", BLOCK_CHECKPOINTS)
    assert net.memory.checkpoint_types == BLOCK_CHECKPOINTS
    assert net.memory.plan.checkpoint_types == BLOCK_CHECKPOINTS  # the schedule the manager runs
    assert net.memory.auto.chosen.checkpoint_types == BLOCK_CHECKPOINTS
    assert "checkpoints: Eltwise, Concat, Pooling" in net.memory.auto.summary()
    assert net.memory.replays > 0
    if where == "tight":
        assert net.memory.bytes_offloaded > 0  # the Tensor Cache had to let checkpoints go, and they came back
    assert got == ref and losses == ref_losses


def test_explicit_checkpoint_types_are_respected():
    params, plans = _tiny_budgets()
    budget = params + plans[DEFAULT_CHECKPOINTS].peak("offload")[0] + 1024  # auto alone would pick the blocks
    net = Net(_graph(RESNET), BACKEND, memory="auto", pool_bytes=budget, checkpoint_types=["Convolution"])
    assert net.checkpoint_types == DEFAULT_CHECKPOINTS and net.memory.name in ("offload", "recompute")
    assert {e.checkpoint_types for e in net.memory.auto.candidates} == {DEFAULT_CHECKPOINTS}
    # The solver prototxt's memory_param counts as explicit too.
    mp = pb.MemoryParameter(checkpoint_type=["Pooling"])
    net = Net(_graph(RESNET), BACKEND, memory="auto", pool_bytes=budget, memory_param=mp)
    assert net.checkpoint_types == ("Pooling",) and net.memory.plan.checkpoint_types == ("Pooling",)
    # A fixed mode without types keeps the paper's default.
    assert Net(_graph(RESNET), BACKEND, memory="recompute").checkpoint_types == DEFAULT_CHECKPOINTS


def test_baseline_and_liveness_win_when_they_fit():
    params, plans = _tiny_budgets()
    net = Net(_graph(RESNET), BACKEND, memory="auto")
    assert net.memory.name == "baseline" and net.memory.auto.candidates == []
    budget = params + plans[DEFAULT_CHECKPOINTS].peak("liveness")[0]
    net = Net(_graph(RESNET), BACKEND, memory="auto", pool_bytes=budget)
    assert net.memory.name == "liveness" and "checkpoints" not in net.memory.auto.summary()


def test_streamed_parameters_fall_back_across_sets():
    params, plans = _tiny_budgets()
    conv, block = plans[DEFAULT_CHECKPOINTS], plans[BLOCK_CHECKPOINTS]
    # Below every plan with resident parameters, above the streamed recompute plans.
    budget = max(conv.streamed_peak("recompute"), block.streamed_peak("recompute"))
    assert budget < params + min(conv.peak("recompute")[0], block.peak("recompute")[0])
    choice = choose(budget, list(plans), lambda types, modes, recompute_limit=0: plans[types])
    assert choice.streams_params and all(e.streams_params for e in choice.candidates)
    assert {e.checkpoint_types for e in choice.candidates} == set(plans)
    win = estimate(plans[choice.checkpoint_types], choice.mode, budget, streams_params=True)
    assert win.moved_bytes >= sum(conv.param_window) > 0  # the parameters cross the link every iteration


def test_host_limit_drops_candidates_that_may_pin_more_and_refuses_when_none_is_left(monkeypatch):
    """A candidate's host bytes are every tensor its mode may evict (the host store's bound) plus the streamed
    parameters; auto weighs only those within the host limit, and refuses at setup, naming the limit and the
    least a plan needs, when the device fits plans that the host cannot hold."""
    params, plans = _tiny_budgets()
    budget = params + (plans[DEFAULT_CHECKPOINTS].peak("offload")[0] + plans[DEFAULT_CHECKPOINTS].peak("liveness")[0]) // 2

    def plan_for(types, modes, recompute_limit=0):
        return plans[types]

    free = choose(budget, list(plans), plan_for)
    assert free.mode in ("offload", "recompute") and free.candidates
    for e in free.candidates:  # the bound, recomputed here from the plan's own tensors
        p = plans[e.checkpoint_types]
        keys = p.schedules[e.mode].info.get("offloadable", ())
        assert e.host_bytes == sum(-(-p.program.tensors[k].nbytes // 1024) * 1024 for k in keys) > 0
    host = {e.host_bytes for e in free.candidates}
    if len(host) > 1:  # a limit between the candidates keeps only those below it
        limit = sorted(host)[0]
        kept = choose(budget, list(plans), plan_for, host_limit=limit)
        assert all(e.host_bytes <= limit for e in kept.candidates)
        assert len(kept.candidates) < len(free.candidates)
    with pytest.raises(UserError, match=r"may pin more host memory than the .* allowed: the least, .* may pin "
                                        rf"{min(host)} bytes"):
        choose(budget, list(plans), plan_for, host_limit=min(host) - 1)
    # The Net's auto reads the limit from SUPERNEURONS_HOST_MEMORY_MB (memory/host.py): refused at setup.
    monkeypatch.setenv("SUPERNEURONS_HOST_MEMORY_MB", "0")
    with pytest.raises(UserError, match="SUPERNEURONS_HOST_MEMORY_MB"):
        Net(_graph(RESNET), BACKEND, memory="auto", pool_bytes=budget)
    monkeypatch.delenv("SUPERNEURONS_HOST_MEMORY_MB")
    assert Net(_graph(RESNET), BACKEND, memory="auto", pool_bytes=budget).memory.name == free.mode
