"""CPU tests of the benchmark tools' logic (tools/bench): searches, planner predictions, argument parsing,
the checkpoint segmenter, the report, and one worker run of our Solver on the CPU. No GPU, no torch needed
(the PyTorch twin test is skipped without torch)."""
from __future__ import annotations

import argparse
import importlib
import json

import pytest

from tools.bench import common, report, torch_nets


@pytest.mark.parametrize("edge", [0, 8, 15, 136, 337, 1000, 2624, 5000])
@pytest.mark.parametrize("start", [8, 64, 336, 2624])
def test_search_edge_finds_the_largest_fitting_multiple(edge, start):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= edge

    assert common.search_edge(fits, start, 8, max_probes=40) == edge // 8 * 8
    assert len(calls) == len(set(calls))  # never probes one value twice
    assert common.largest_fitting(lambda b: b <= edge, 8, start) == edge // 8 * 8


def test_search_edge_near_a_good_guess_takes_few_probes():
    calls = []
    assert common.search_edge(lambda b: calls.append(b) or b <= 340, 336, 8, 8) == 336
    assert calls == [336, 344]


def test_parse_batches_and_nets():
    assert common.parse_batches("") == []
    assert common.parse_batches("64,128") == [64, 128]
    per = common.parse_batches("resnet50=64:128,alexnet=256")
    assert per == {"resnet50": [64, 128], "alexnet": [256]}
    assert common.batches_for("resnet50", per, [1]) == [64, 128]
    assert common.batches_for("vgg16", per, [32]) == [32]
    assert common.batches_for("vgg16", [16], [32]) == [16]
    assert common.parse_nets("resnet50, alexnet") == ["resnet50", "alexnet"]
    with pytest.raises(SystemExit, match="unknown net"):
        common.parse_nets("resnet51")
    assert common.parse_size("12G") == 12 << 30


def test_net_batches_pairs_each_net_with_its_batches():
    args = argparse.Namespace(nets="resnet50,alexnet", batches="resnet50=64:128")
    rn, ax = common.NETS["resnet50"], common.NETS["alexnet"]
    assert common.net_batches(args) == [("resnet50", rn, 64), ("resnet50", rn, 128),
                                        ("alexnet", ax, ax.speed_batch)]
    assert common.net_batches(args, [200]) == [("resnet50", rn, 64), ("resnet50", rn, 128), ("alexnet", ax, 200)]
    args.batches = "16"
    assert common.net_batches(args) == [("resnet50", rn, 16), ("alexnet", ax, 16)]


def test_every_benchmark_parses_its_arguments():
    for name in ("speed", "speed_zoo", "wider", "deeper", "pool", "cache", "workspace", "memory_trace", "bn_kernels",
                 "conv_algos"):
        mod = importlib.import_module(f"tools.bench.{name}")
        assert mod.__doc__ and "python3 -m tools.bench." in mod.__doc__
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0


def test_predicted_widest_batch_is_the_planner_edge():
    budget, ws = 12 << 30, 256 << 20
    best, need = common.predict_widest("resnet50", budget, ws)
    assert best > 0 and best % 8 == 0
    assert need.mode is not None and need.total(need.mode, ws) <= budget
    assert common.plan_need("resnet50", best + 8, budget, ws).mode is None


def test_predicted_deepest_resnet_is_the_planner_edge():
    # Parameters stream from the host when they do not fit, so the host's pinned memory bounds the depth. The
    # figures are an eighth of a GPU's (the edge is near N=40, five plans, where 6 GiB at batch 16 takes twice
    # as many plans of deeper nets).
    budget, ws, host, batch = 768 << 20, 32 << 20, 1 << 30, 2
    n, need = common.predict_deepest(budget, ws, batch=batch, host_limit=host)
    assert n > 0 and n % 8 == 0 and need.mode is not None and need.streams and need.host <= host
    assert need.total(need.mode, ws) <= budget
    assert common.plan_need(f"deep:{n + 8}", batch, budget, ws, host_limit=host).mode is None
    assert common.deep_depth(544) == 1766 and common.deep_depth(176) == 662  # GPU.md's PyTorch figures


def test_bn_kernel_configs_and_shapes():
    bn_kernels = importlib.import_module("tools.bench.bn_kernels")
    never = 1 << 30
    assert bn_kernels.parse_configs("walk=0:0,rows=1024:0,chan=1024:8192:256") == {
        "walk": (0, 0, 0, never), "rows": (1024, 0, 0, never), "chan": (1024, 8192, 256, never)}
    with pytest.raises(SystemExit, match="NAME=ROWS_MIN:MIN_BLOCK"):
        bn_kernels.parse_configs("rows=1024")
    shapes = bn_kernels.bn_shapes("resnet50", 64)
    assert sum(shapes.values()) == 53 and shapes[(64, 64, 12544)] == 1  # every fused BatchNorm; bn_conv1 alone
    convs = importlib.import_module("tools.bench.conv_algos").conv_shapes("resnet50", 64)
    assert sum(convs.values()) == 53 and len(convs) == 20


def test_pool_kernel_shapes_say_which_poolings_take_their_relus_backward():
    pool_kernels = importlib.import_module("tools.bench.pool_kernels")
    window = ((3, 3), (2, 2), (0, 0))
    assert pool_kernels.pool_shapes("squeezenet", 64) == {
        ((64, 96, 111, 111), (64, 96, 55, 55), *window, True): 1,
        ((64, 256, 55, 55), (64, 256, 27, 27), *window, False): 1,
        ((64, 512, 27, 27), (64, 512, 13, 13), *window, False): 1}
    vgg = pool_kernels.pool_shapes("vgg16", 64)
    assert sum(vgg.values()) == 5 and all(key[2] == key[3] == (2, 2) and key[5] for key in vgg)
    assert all(key[1][2] * 2 == key[0][2] for key in vgg)  # the windows tile the planes


def test_deeper_verifies_a_given_depth_without_the_search(tmp_path, monkeypatch):
    deeper = importlib.import_module("tools.bench.deeper")
    monkeypatch.setattr(common, "predict_deepest", lambda *a, **k: pytest.fail("the search ran"))
    assert deeper.main(["--start", "8", "--predict-only", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "deeper.json").read_text())
    assert data["predicted_n"] == 8 and data["need"]["mode"] is not None
    assert deeper.main(["--no-ours", "--no-torch", "--out", str(tmp_path), "--tag", "t"]) == 0


def test_solver_data_type_bfloat16_halves_the_streamed_host_bytes_of_weights_gradients_and_history(tmp_path):
    from superneurons.layers.base import count
    from superneurons.memory.pool import round_up

    # The reference: every parameter's elements (shared ones once), at 4 and at 2 bytes, rounded as the pool
    # rounds, for the value, its gradient and one momentum (learnable ones; BatchNorm's statistics have none).
    graph = common.train_graph("deep:8", 2, "bf16")
    decls = [d for node in graph.nodes for d in node.layer.params]
    want = {size: sum(round_up(size * count(d.shape)) * (3 if d.learnable else 2) for d in decls) for size in (4, 2)}
    budget, ws, host = 768 << 20, 32 << 20, 1 << 30
    needs = {m: common.plan_need("deep:8", 2, budget, ws, host, "bf16", m) for m in ("FLOAT", "BFLOAT16")}
    for m, size in (("FLOAT", 4), ("BFLOAT16", 2)):
        assert needs[m].params + needs[m].history == want[size]
    # the activations are the same net's in both: only the parameters' part of the host bytes halves
    assert needs["FLOAT"].peaks == needs["BFLOAT16"].peaks
    deeper = importlib.import_module("tools.bench.deeper")
    assert deeper.main(["--start", "8", "--predict-only", "--precision", "bf16", "--solver-data-type", "BFLOAT16",
                        "--budget", "768M", "--workspace", "32M", "--batch", "2", "--host-limit", "1G",
                        "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "deeper_bf16_solverBFLOAT16.json").read_text())
    assert data["solver_data_type"] == "BFLOAT16" and data["need"]["params"] == needs["BFLOAT16"].params
    assert data["tables"][0]["rows"][0][1] == "bf16, solver_data_type BFLOAT16"
    with pytest.raises(SystemExit):
        deeper.main(["--predict-only", "--solver-data-type", "INT", "--out", str(tmp_path)])


def _ops(graph):
    body = [n for n in graph.nodes if not n.layer.is_data and n.layer.param.type != "SoftmaxWithLoss"]
    return [torch_nets.OpInfo(n.name, n.layer.param.type, list(n.bottoms), list(n.tops)) for n in body]


def test_segments_are_residual_blocks_and_pooled_chains():
    graph = common.train_graph("resnet50", 2)
    ops = _ops(graph)
    segs = torch_nets.segments_of(ops, "data", "fc1000")
    blocks = [s for s in segs if s.block]
    assert len(blocks) == 16  # 3 + 4 + 6 + 3 bottleneck blocks
    covered = [i for s in segs for i in s.ops]
    assert covered == list(range(len(ops)))  # every layer once, in order
    for a, b in zip(segs, segs[1:]):
        assert a.output == b.input
    # in-place ReLU on a Split's top or a segment input would corrupt a branch or a checkpoint input
    for s in segs:
        for i in s.ops:
            if ops[i].inplace_ok:
                assert ops[i].bottoms[0] != s.input


def test_chain_segments_close_after_pooling():
    graph = common.train_graph("alexnet", 2)
    ops = _ops(graph)
    logits = next(n for n in graph.nodes if n.layer.param.type == "SoftmaxWithLoss").bottoms[0]
    segs = torch_nets.segments_of(ops, graph.nodes[0].tops[0], logits)
    assert not any(s.block for s in segs)
    assert [ops[s.ops[-1]].type for s in segs[:-1]] == ["Pooling"] * (len(segs) - 1)


def test_report_renders_tables_and_targets(tmp_path):
    args = common.base_parser("doc", ["resnet50"]).parse_args(["--out", str(tmp_path)])
    t = [common.target("wider ResNet-50", ">= 3x", 0.55, 3.0, "why"), common.target("speed", ">= 1x", 1.2, 1.0)]
    common.finish("wider", "Widest batch", args, ["net", "ours"], [["ResNet-50", 184]], targets=t)
    doc = json.loads((tmp_path / "wider.json").read_text())
    text = report.section(report.load(tmp_path)[0])
    assert "| ResNet-50 | 184 |" in text
    assert "**missed** by 2.45" in text and "(met)" in text
    assert doc["targets"][0]["shortfall"] == pytest.approx(2.45)


def test_worker_trains_our_solver_on_the_cpu():
    task = dict(kind="ours", net="cifar10_quick", batch=4, memory="liveness", device="cpu", iterations=1,
                warmup=1, budget=64 << 20, workspace=0)
    [r] = common.run_worker([task], timeout=240)
    assert r["ok"], r.get("error")
    assert r["img_per_s"] > 0 and r["pool_bytes"] <= 64 << 20
    assert r["per_iteration"]["allocs"] > 0  # liveness allocates per step


def test_worker_reports_a_failing_task_and_runs_the_next():
    bad = dict(kind="ours", net="cifar10_quick", batch=4, memory="baseline", device="cpu", iterations=1,
               warmup=1, budget=1 << 20, workspace=0)
    ok = dict(bad, budget=None)
    r_bad, r_ok = common.run_worker([bad, ok], timeout=240)
    assert not r_bad["ok"] and r_bad["fits"] is False
    assert r_ok["ok"], r_ok.get("error")


def test_torch_twin_matches_our_graph_shapes_and_checkpoint_gives_the_same_gradients():
    torch = pytest.importorskip("torch")
    graph = common.train_graph("deep:1", 2)
    net_cls = torch_nets._proto_net_class()
    torch.manual_seed(0)
    plain = net_cls(graph, checkpoint=False).train()
    ck = net_cls(graph, checkpoint=True).train()
    ck.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 224, 224)
    y = torch.tensor([1, 3])
    losses = []
    for m in (plain, ck):
        loss = m(x, y)  # the first forward checks every blob's shape against our graph
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), ck.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


def _ours_and_twin(net: str, batch: int, tmp_path):
    """Our CPU net (pycaffe API, every blob kept) after one forward, and the PyTorch twin built from the same
    prototxt holding our weights. Dropout's mask cannot be matched across the two, so its ratio is 0 on both."""
    import superneurons.pycaffe as caffe
    from google.protobuf import text_format

    param = common.net_param(net, batch)
    for layer in param.layer:
        if layer.type == "Dropout":
            layer.dropout_param.dropout_ratio = 0.0
    path = tmp_path / f"{net}.prototxt"
    path.write_text(text_format.MessageToString(param))
    caffe.set_mode_cpu()
    ours = caffe.Net(str(path), caffe.TRAIN)
    ours.forward()
    twin = torch_nets._proto_net_class()(ours.runtime.graph).train()  # the graph ours runs, dropout 0 included
    params = {name: [b.data for b in blobs] for name, blobs in ours.params.items()}
    return ours, twin, params


# Every net of the speed table; the twin's first forward also checks each blob's shape against our graph.
# The reference is the twin in float64: through a hundred BatchNorms over a batch of 2, float32 rounding
# alone moves the logits by up to ~5e-4 of their range (PyTorch's own float32 forward as much as ours), so
# ours must be as close to it as PyTorch's float32 forward is, within a factor of 3.
@pytest.mark.parametrize("net", common.SPEED_NETS)
def test_torch_twin_from_the_prototxt_computes_our_forward(net, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed: the PyTorch twins cannot be built")
    ours, twin, params = _ours_and_twin(net, 2, tmp_path)
    n_learnable = sum(len(b) for name, b in params.items()
                      if ours.layer_dict[name].type != "BatchNorm")  # BatchNorm's blobs are statistics
    assert torch_nets.copy_parameters(twin, params) == n_learnable
    x = torch.from_numpy(ours.blobs[twin.data].data.copy())
    with torch.no_grad():
        twin32 = twin.logits(x).numpy()
        exact = twin.double().logits(x.double()).numpy()
    want = ours.blobs[twin.logits_blob].data
    assert want.shape == exact.shape == twin32.shape
    scale = float(abs(exact).max())
    assert scale > 0
    err, err_torch = float(abs(want - exact).max()), float(abs(twin32 - exact).max())
    assert err <= 3 * err_torch + 1e-5 * scale, (f"{net}: max |ours - float64 twin| {err:.3g}, PyTorch float32's "
                                                 f"{err_torch:.3g}, max |logit| {scale:.3g}")


def test_torch_twin_refuses_a_net_torchvision_lacks():
    pytest.importorskip("torch", reason="torch is not installed")
    with pytest.raises(ValueError, match="torchvision has no model"):
        torch_nets.build("mobilenet", "plain", 2, source="torchvision")


def test_speed_zoo_compares_the_same_prototxt_and_states_both_sides_settings(tmp_path, monkeypatch):
    speed_zoo = importlib.import_module("tools.bench.speed_zoo")
    calls = []
    speeds = {("prototxt", "fp32"): 200.0, ("prototxt", "fp32-cl"): 250.0, ("prototxt", "bf16-cl"): 500.0,
              ("prototxt", "bf16-cl-compile"): 600.0, ("torchvision", "fp32"): 400.0}

    def fake_worker(tasks, timeout, env=None, log=None):
        calls.append((tasks, env))
        if tasks[0]["kind"] == "ours":
            return [{"ok": True, "img_per_s": 300.0, "memory_mode": "baseline", "tf32_convolutions": False,
                     "tf32_gemm": False, "algorithm_choice": "heuristics"} for _ in tasks]
        return [{"ok": True, "img_per_s": speeds[t["source"], t["config"]], "source": t["source"],
                 "compile_s": 12.5 if t["config"].endswith("compile") else None,
                 "cudnn_allow_tf32": t["tf32"], "matmul_allow_tf32": False, "cudnn_benchmark": t["benchmark"]}
                for t in tasks]

    monkeypatch.setattr(common, "run_worker", fake_worker)
    assert speed_zoo.main(["--nets", "squeezenet,mobilenet", "--tf32", "off", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "speed_zoo.json").read_text())
    header = doc["tables"][0]["header"]
    squeeze, mobile = (dict(zip(header, row)) for row in doc["tables"][0]["rows"])
    assert squeeze["ours fp32 img/s"] == 300.0
    assert squeeze["PyTorch fp32 channels_last img/s"] == 250.0
    assert squeeze["PyTorch bf16-cl-compile compile s"] == 12.5  # compile time apart from the steady state
    # float32 against PyTorch's float32 configurations only: 300 / 200 and 300 / 250
    assert squeeze["ours fp32 / PyTorch fp32"] == 1.5 and squeeze["ours fp32 / PyTorch fp32-cl"] == 1.2
    assert "ours fp32 / PyTorch bf16-cl" not in squeeze
    assert squeeze["PyTorch torchvision fp32 img/s"] == 400.0 and squeeze["ratio vs torchvision"] == 0.75
    assert mobile["PyTorch torchvision fp32 img/s"] is None  # torchvision has no MobileNet v1
    torch_runs = [[(t["source"], t["config"]) for t in tasks] for tasks, _ in calls if tasks[0]["kind"] == "torch"]
    configs = [("prototxt", c) for c in speed_zoo.DEFAULT_CONFIGS]
    assert torch_runs == [configs + [("torchvision", "fp32")], configs]
    assert all(env == {"SUPERNEURONS_TF32": "0"} for tasks, env in calls if tasks[0]["kind"] == "ours")
    assert all("precision" not in t for tasks, _ in calls if tasks[0]["kind"] == "ours" for t in tasks)
    assert doc["settings"]["torch"] == {"cudnn_allow_tf32": False, "matmul_allow_tf32": False, "cudnn_benchmark": True}
    assert "TF32 convolutions: ours off, PyTorch off" in doc["tables"][0]["title"]
    assert "PyTorch cudnn.benchmark on" in doc["tables"][0]["title"]
    assert doc["ckpt_batches"] == {}  # part 2 only when asked for


def test_speed_zoo_compares_our_half_precision_with_pytorch_autocast(tmp_path, monkeypatch):
    speed_zoo = importlib.import_module("tools.bench.speed_zoo")

    def fake_worker(tasks, timeout, env=None, log=None):
        if tasks[0]["kind"] == "ours":
            return [{"ok": True, "img_per_s": 1000.0 if t.get("precision") == "bf16" else 300.0,
                     "memory_mode": "baseline"} for t in tasks]
        return [{"ok": True, "img_per_s": 800.0 if t["config"] == "bf16-cl" else 250.0} for t in tasks]

    monkeypatch.setattr(common, "run_worker", fake_worker)
    assert speed_zoo.main(["--nets", "mobilenet", "--precisions", "fp32,bf16", "--torch-configs", "fp32-cl,bf16-cl",
                           "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "speed_zoo.json").read_text())
    row = dict(zip(doc["tables"][0]["header"], doc["tables"][0]["rows"][0]))
    assert row["ours bf16 / PyTorch bf16-cl"] == 1.25 and row["ours fp32 / PyTorch fp32-cl"] == 1.2
    assert "ours bf16 / PyTorch fp32-cl" not in row
    assert {t["name"] for t in doc["targets"]} == {"speed MobileNet b64 ours fp32 / PyTorch fp32-cl",
                                                   "speed MobileNet b64 ours bf16 / PyTorch bf16-cl"}
    with pytest.raises(SystemExit):
        speed_zoo.main(["--nets", "mobilenet", "--torch-configs", "fp8", "--out", str(tmp_path)])


def test_speed_times_the_same_prototxt_first_and_torchvision_where_it_has_the_net():
    speed = importlib.import_module("tools.bench.speed")
    assert speed.torch_sources("resnet50", "both") == ["prototxt", "torchvision"]
    assert speed.torch_sources("mobilenet", "both") == ["prototxt"]
    assert speed.torch_sources("inception_v4", "prototxt") == ["prototxt"]
    with pytest.raises(SystemExit, match="torchvision has no model of mobilenet"):
        speed.torch_sources("mobilenet", "torchvision")


def test_speed_zoo_starts_no_net_past_its_time_limit_and_still_writes_the_table(tmp_path, monkeypatch):
    speed_zoo = importlib.import_module("tools.bench.speed_zoo")
    monkeypatch.setattr(common, "run_worker", lambda *a, **k: pytest.fail("a worker started past the limit"))
    assert speed_zoo.main(["--nets", "vgg16,densenet121", "--time-limit", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "speed_zoo.json").read_text())
    assert doc["skipped"] == ["vgg16", "densenet121"]
    assert [r[0] for r in doc["tables"][0]["rows"]] == ["VGG16", "DenseNet-121"]
    assert all("--time-limit" in r[-1] for r in doc["tables"][0]["rows"])


def test_speed_zoo_repeats_alternate_the_sides_and_rows_take_the_medians(tmp_path, monkeypatch):
    speed_zoo = importlib.import_module("tools.bench.speed_zoo")
    ours_speeds, torch_speeds = iter([900.0, 1400.0, 1000.0]), iter([1200.0, 1000.0, 1100.0])
    kinds = []

    def fake_worker(tasks, timeout, env=None, log=None):
        kinds.append(tasks[0]["kind"])
        speeds = ours_speeds if tasks[0]["kind"] == "ours" else torch_speeds
        return [{"ok": True, "img_per_s": next(speeds), "memory_mode": "baseline"} for _ in tasks]

    monkeypatch.setattr(common, "run_worker", fake_worker)
    assert speed_zoo.main(["--nets", "densenet121", "--repeats", "3", "--no-torchvision", "--torch-configs", "fp32",
                           "--out", str(tmp_path)]) == 0
    assert kinds == ["ours", "torch"] * 3
    doc = json.loads((tmp_path / "speed_zoo.json").read_text())
    row = doc["tables"][0]["rows"][0]
    assert row[3:5] == [1000.0, 1100.0] and row[5] == pytest.approx(1000.0 / 1100.0, abs=1e-3)
    assert doc["raw"]["densenet121"]["ours"][0]["runs"] == [900.0, 1400.0, 1000.0]


def test_speed_zoo_refuses_fewer_than_one_repeat(capsys):
    speed_zoo = importlib.import_module("tools.bench.speed_zoo")
    with pytest.raises(SystemExit) as stop:
        speed_zoo.main(["--nets", "densenet121", "--repeats", "0"])
    assert stop.value.code == 2 and "--repeats must be 1 or more, not 0" in capsys.readouterr().err


def test_each_precision_maps_to_the_pytorch_configuration_that_stores_the_same_type():
    from superneurons.dtypes import PRECISIONS, dtype_name

    speed_zoo = importlib.import_module("tools.bench.speed_zoo")
    assert set(common.PRECISION_TORCH_CONFIG) == set(PRECISIONS)  # every --precision of train
    assert common.PRECISION_TORCH_CONFIG["fp32"] == "fp32"  # float32: PyTorch's default, eager NCHW
    for precision, name in common.PRECISION_TORCH_CONFIG.items():
        config = torch_nets.TORCH_CONFIGS[name]
        half = precision != "fp32"
        # autocast computes in the type our half precision stores; float32 runs without autocast
        assert config.autocast == (dtype_name(PRECISIONS[precision]) if half else None)
        assert config.channels_last == half and not config.compiled
        assert speed_zoo.comparable(precision, name)  # the pairing speed_zoo's ratios use too
    assert common.precision_tag("", "fp32") == "" and common.precision_tag("resnets", "bf16") == "resnets_bf16"


@pytest.mark.parametrize("bench", ["wider", "deeper"])
def test_memory_benchmarks_take_a_precision(bench, capsys):
    mod = importlib.import_module(f"tools.bench.{bench}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--precision {fp32,bf16,fp16}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        mod.main(["--precision", "fp8", "--predict-only"])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_wider_predicts_about_twice_the_batch_in_bfloat16(tmp_path):
    # Weights, gradients and momentum stay float32 (solver_data_type), activations and their gradients halve:
    # with the host store unbounded the widest batch doubles, up to the few float32-only blobs (the loss).
    wider = importlib.import_module("tools.bench.wider")
    budget, ws = "4G", 256 << 20
    for precision in ("fp32", "bf16"):
        assert wider.main(["--predict-only", "--nets", "resnet50", "--budget", budget, "--host-limit", "1024G",
                           "--precision", precision, "--out", str(tmp_path)]) == 0
    fp32 = json.loads((tmp_path / "wider.json").read_text())
    bf16 = json.loads((tmp_path / "wider_bf16.json").read_text())  # its own file: neither replaces the other
    rows = [dict(zip(d["tables"][0]["header"], d["tables"][0]["rows"][0])) for d in (fp32, bf16)]
    assert [(r["ours precision"], r["PyTorch config"]) for r in rows] == [("fp32", "fp32"), ("bf16", "bf16-cl")]
    assert (fp32["precision"], bf16["precision"], bf16["torch_config"]) == ("fp32", "bf16", "bf16-cl")
    assert "ours bf16, PyTorch bf16 autocast channels_last" in bf16["title"]
    assert bf16["targets"][0]["name"] == "wider ResNet-50 bf16"
    b32, b16 = rows[0]["planner batch"], rows[1]["planner batch"]
    assert b32 > 0 and 1.8 <= b16 / b32 <= 2.2, (b32, b16)
    need = bf16["raw"]["resnet50"]["need"]
    assert need["peaks"][need["mode"]] + need["params"] + need["history"] + ws <= 4 << 30 or need["streams"]
    # the bfloat16 edge is beyond float32's reach: the same batch in float32 does not fit the budget
    assert common.plan_need("resnet50", b16, 4 << 30, ws, 1 << 40, "fp32").mode is None


def test_half_precision_halves_the_planned_activations():
    from superneurons.dtypes import PRECISIONS

    # What grows with the batch is activations and their gradients alone (the half working copies of the
    # weights do not), so the growth from batch 8 to 16 is the per-item bytes, which half precision halves.
    growth = {p: common.plan_need("resnet50", 16, precision=p).peaks["baseline"]
              - common.plan_need("resnet50", 8, precision=p).peaks["baseline"] for p in ("fp32", "bf16", "fp16")}
    ratio = PRECISIONS["bf16"].itemsize / PRECISIONS["fp32"].itemsize
    assert growth["bf16"] == growth["fp16"]
    assert ratio * 0.98 <= growth["bf16"] / growth["fp32"] <= ratio * 1.05  # float32-only: the loss, the labels


def test_wider_and_deeper_run_ours_in_the_precision_and_pytorch_in_its_configuration(tmp_path, monkeypatch):
    wider, deeper = importlib.import_module("tools.bench.wider"), importlib.import_module("tools.bench.deeper")
    tasks_seen: list[dict] = []

    def fake_worker(tasks, timeout, env=None, log=None):
        tasks_seen.extend(tasks)
        return [{"ok": True, "widest": 64, "deepest_n": 8, "depth": common.deep_depth(8)} for _ in tasks]

    monkeypatch.setattr(common, "run_worker", fake_worker)
    for precision, config in (("bf16", "bf16-cl"), ("fp16", "fp16-cl"), ("fp32", "fp32")):
        tasks_seen.clear()
        assert wider.main(["--nets", "cifar10_quick", "--budget", "1G", "--torch-variants", "plain,checkpoint",
                           "--precision", precision, "--out", str(tmp_path)]) == 0
        assert deeper.main(["--start", "8", "--precision", precision, "--out", str(tmp_path)]) == 0
        ours = [t for t in tasks_seen if t["kind"].startswith("ours")]
        theirs = [t for t in tasks_seen if t["kind"].startswith("torch")]
        assert [t["kind"] for t in ours] == ["ours_widest", "ours_deepest"]
        # float32 runs pass no precision (as speed_zoo's), so they run on any build of ours
        assert all(t.get("precision") == (None if precision == "fp32" else precision) for t in ours)
        assert [(t["kind"], t["variant"]) for t in theirs] == [("torch_widest", "plain"), ("torch_widest", "checkpoint"),
                                                               ("torch_deepest", "plain"),
                                                               ("torch_deepest", "checkpoint")]
        assert all(t["config"] == config for t in theirs)
        scale = 1 if precision == "fp32" else wider.HALF_START
        assert [t["start"] for t in theirs] == [100 * scale, 100 * scale, common.TORCH_DEEP_PLAIN_N * scale,
                                                common.TORCH_DEEP_CHECKPOINT_N * scale]
        suffix = "" if precision == "fp32" else f"_{precision}"
        doc = json.loads((tmp_path / f"deeper{suffix}.json").read_text())
        assert [r[1] for r in doc["tables"][0]["rows"]] == [precision, precision, config, config]


def test_speed_zoo_takes_pytorch_checkpoints_widest_batches_from_the_float32_wider_run_only(tmp_path):
    speed_zoo = importlib.import_module("tools.bench.speed_zoo")
    (tmp_path / "wider.json").write_text(json.dumps({"torch_widest": {"checkpoint": {"resnet50": 328}}}))
    (tmp_path / "wider_bf16.json").write_text(json.dumps({"precision": "bf16",
                                                          "torch_widest": {"checkpoint": {"resnet50": 680}}}))
    args = common.base_parser("doc", ["resnet50"]).parse_args(["--out", str(tmp_path)])
    args.ckpt_batches = ""
    assert speed_zoo.ckpt_batches(args, ["resnet50"]) == {"resnet50": 328}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_checkpointed_blocks_recompute_under_the_autocast_of_the_matching_configuration(precision):
    # What the memory benchmarks' per-block checkpoint variant does in half precision, on the CPU: ProtoNet's
    # checkpointed segments run inside the configuration's autocast region, and the recomputed forward in
    # backward must run under the same autocast (else non-reentrant checkpointing finds saved tensors of
    # another type) and give the plain variant's loss and gradients.
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from superneurons.graph.build import build_graph
    from superneurons.proto import superneurons_pb2 as pb
    from tools.models.make_resnet import make_resnet

    config = torch_nets.TORCH_CONFIGS[common.PRECISION_TORCH_CONFIG[precision]]
    dtype = getattr(torch, config.autocast)
    graph = build_graph(make_resnet([1, 1, 1, 1], batch=2, side=64), pb.TRAIN)
    net_cls = torch_nets._proto_net_class()
    torch.manual_seed(0)
    plain = net_cls(graph, checkpoint=False).train()
    ck = net_cls(graph, checkpoint=True).train()
    ck.load_state_dict(plain.state_dict())
    assert sum(s.block for s in ck.segments) == 4  # the residual blocks are checkpointed
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    y = torch.tensor([1, 3])
    runs = {}
    for name, model in (("plain", plain), ("checkpoint", ck)):
        model.to(memory_format=torch.channels_last)
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.dtype)) for m in model.modules()
                 if isinstance(m, torch.nn.Conv2d)]
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x, y)
        forwards = len(seen)
        loss.backward()
        for h in hooks:
            h.remove()
        assert set(seen) == {dtype}, (name, set(seen))
        assert (len(seen) > forwards) == (name == "checkpoint")  # the checkpointed blocks ran again
        runs[name] = (float(loss.detach()), [p.grad.clone() for p in model.parameters()])
    assert runs["checkpoint"][0] == pytest.approx(runs["plain"][0], rel=1e-3)
    for a, b in zip(runs["plain"][1], runs["checkpoint"][1]):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(a.abs().max()) + 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["bf16-cl", "fp16-cl"])
def test_checkpointed_blocks_recompute_under_autocast(config):
    # The per-block checkpoint variant of the memory benchmarks in half precision: the recomputed forward
    # must run under the same autocast (else non-reentrant checkpointing finds saved tensors of another type)
    # and give the plain variant's loss and gradients.
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    torch.backends.cudnn.deterministic = True
    dtype = getattr(torch, torch_nets.TORCH_CONFIGS[config].autocast)
    runs = {}
    for variant in ("plain", "checkpoint"):
        tr = torch_nets.Trainer("deep:1", variant, 2, "prototxt", config)  # seeded: the same weights and batch
        tr.set_batch(2)
        seen = []
        for mod in tr.model.modules():
            if isinstance(mod, torch.nn.Conv2d):
                mod.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        loss = tr._loss()
        forwards = len(seen)
        loss.backward()
        assert set(seen) == {dtype}, (variant, set(seen))
        assert (len(seen) > forwards) == (variant == "checkpoint")  # the checkpointed blocks ran again
        runs[variant] = (float(loss.detach()), [p.grad.float().clone() for p in tr.model.parameters()])
    assert runs["checkpoint"][0] == pytest.approx(runs["plain"][0], rel=1e-3)
    for a, b in zip(runs["plain"][1], runs["checkpoint"][1]):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-3 * float(a.abs().max()) + 1e-6)


def test_fits_in_memory_says_whether_the_steps_ran_out_and_always_releases(monkeypatch):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no device here: the steps are plain Python
    released = []

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    def broken():
        raise ValueError("not a memory problem")

    assert torch_nets.fits_in_memory(lambda: None, lambda: released.append("fit")) is True
    assert torch_nets.fits_in_memory(out_of_memory, lambda: released.append("oom")) is False
    with pytest.raises(ValueError):
        torch_nets.fits_in_memory(broken, lambda: released.append("error"))
    assert released == ["fit", "oom", "error"]


def test_speed_zoo_keeps_the_nets_it_finished_when_killed(tmp_path, monkeypatch):
    """After each net speed_zoo.json holds the figures so far (noted partial), so a run an outer time limit kills
    keeps them; a finished run's file is whole and not partial."""
    speed_zoo = importlib.import_module("tools.bench.speed_zoo")
    started = []

    def fake_worker(tasks, timeout, env=None, log=None):
        started.append(tasks[0]["net"])
        if tasks[0]["net"] == "mobilenet":
            raise KeyboardInterrupt  # the kill arrives while the second net runs
        return [{"ok": True, "img_per_s": 100.0 + len(started), "memory_mode": "baseline"} for _ in tasks]

    monkeypatch.setattr(common, "run_worker", fake_worker)
    with pytest.raises(KeyboardInterrupt):
        speed_zoo.main(["--nets", "squeezenet,mobilenet", "--no-torchvision", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "speed_zoo.json").read_text())
    assert doc["partial"] and list(doc["raw"]) == ["squeezenet"] and "partial" in doc["notes"][0]
    [row] = doc["tables"][0]["rows"]
    assert row[0] == "SqueezeNet" and row[3] == 101.0
    monkeypatch.setattr(common, "run_worker", lambda tasks, *a, **k: [{"ok": True, "img_per_s": 50.0}] * len(tasks))
    assert speed_zoo.main(["--nets", "squeezenet,mobilenet", "--no-torchvision", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "speed_zoo.json").read_text())
    assert not doc["partial"] and len(doc["tables"][0]["rows"]) == 2 and doc["notes"] == []
    assert sorted(p.name for p in tmp_path.glob("speed_zoo.json*")) == ["speed_zoo.json"]
