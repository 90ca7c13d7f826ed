"""Training speed of one net with its per-layer GPU profile: SuperNeurons (cuda backend, `baseline` memory
mode) beside PyTorch, same run. ResNet-50 by default; --net names another net of the speed table
(tools/bench/common.py: NETS), whose description below reads the same with that net's
models/<net>/<net>_dummy*.prototxt.

    python3 -m tools.bench.speed [--net resnet50] [--batch 64] [--iterations 20] [--warmup 5] [--label optimized]
                                [--precision fp32|bf16|fp16] [--torch-config fp32|fp32-cl|bf16-cl|...]
                                [--torch-source both|prototxt|torchvision] [--no-torch] [--out DIR]

Ours: the solver models/resnet50/resnet50_dummy_solver.prototxt (SGD, momentum 0.9, weight decay 1e-4) on
models/resnet50/resnet50_dummy.prototxt (DummyData 64x3x224x224, BatchNorm in training mode + Scale,
SoftmaxWithLoss). The first warm-up iteration draws the batch; the DummyData layer is then frozen so every
iteration trains on that same device-resident batch, as PyTorch's loop below reuses one tensor. Each timed
iteration is the solver's own `step`: clear diffs, forward (the loss read to the host, as training does),
backward, SGD update. The clock stops after a device synchronize.

PyTorch (tools/bench/torch_nets.py's Trainer): the net built from the same prototxt (source "prototxt", the
like-for-like comparison) and, with --torch-source both (the default) and where torchvision has the net,
torchvision's model too; fp32, NCHW, SGD with the solver's lr, momentum and weight decay, cross-entropy,
zero_grad / forward / backward / step, timed with torch.cuda.synchronize, with cudnn.benchmark on and off.
TF32: cuDNN convolutions may use it on both sides (PyTorch's cudnn.allow_tf32 and our SUPERNEURONS_TF32,
both on by default); GEMMs run in FP32 on both (PyTorch's matmul.allow_tf32 off, our cuBLAS default math).
The JSON records each side's settings as read back.
Note: Caffe's ResNet-50 puts the stride-2 on the 1x1 branch2a convolution, torchvision (v1.5) on the 3x3;
Caffe's costs ~3.9 GFLOPs per image forward against torchvision's ~4.1.

Prints a table and writes bench_<net>[_LABEL].json to --out (default $OUT or .).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from tools.bench import common, torch_nets

ROOT = Path(__file__).resolve().parents[2]
TOP_LAYERS = 20  # the profile's per-layer list: the slowest layer directions, per iteration
HOST_FUNCTIONS = 25  # the host profile's list: the Python functions with the most own time
KERNELS = 40  # the kernel profiles' lists: the kernels with the most GPU time


def solver_path(net: str) -> Path:
    return ROOT / f"models/{net}/{net}_dummy_solver.prototxt"


def ours(net: str, batch: int, warmup: int, iterations: int, precision: str | None = None) -> dict:
    os.chdir(ROOT)
    from superneurons.backend import get_backend
    from superneurons.graph.batch import set_batch
    from superneurons.io.prototxt import read_solver
    from superneurons.solver.solver import Solver

    solver_file = solver_path(net)
    param = read_solver(str(solver_file))
    param.display = 0
    param.max_iter = warmup + iterations
    param.test_interval = 0  # the profiles below step past max_iter: no test pass inside them
    t0 = time.perf_counter()
    backend = get_backend("cuda", 0)
    from superneurons.io.prototxt import read_net

    net_param = read_net(str(ROOT / param.net))
    set_batch(net_param, batch)
    param.ClearField("net")
    param.net_param.CopyFrom(net_param)
    solver = Solver(param, str(solver_file), backend=backend, memory="baseline", precision=precision)
    build_s = time.perf_counter() - t0
    losses: list[float] = []
    solver.callbacks.append(lambda s, it, loss: losses.append(float(loss)))
    data_layer = next(n.layer for n in solver.net.graph.nodes if n.layer.is_data)
    t0 = time.perf_counter()
    solver.step(1)  # draws the batch, compiles every kernel, picks the cuDNN algorithms
    data_layer.forward = lambda bottom, top: None  # the batch stays in place (instance attribute)
    backend.synchronize()
    first_s = time.perf_counter() - t0
    solver.step(warmup - 1)
    backend.synchronize()
    t0 = time.perf_counter()
    solver.step(iterations)
    backend.synchronize()
    elapsed = time.perf_counter() - t0
    return {"img_per_s": batch * iterations / elapsed, "ms_per_iter": 1e3 * elapsed / iterations,
            "build_s": build_s, "first_iteration_s": first_s, "losses": losses,
            "loss_falls": bool(losses[-1] < losses[0]), "pool_bytes": solver.net.pool.capacity,
            "host_functions": host_functions(solver, backend, iterations),
            "host_ms_per_iter": host_breakdown(solver, backend, iterations),
            "gpu_ms_per_iter": gpu_breakdown(solver, backend, min(iterations, 5)), "conv_paths": conv_paths(),
            "gpu_ms_per_iter_by_kernel": kernel_profile(lambda: solver.step(1), backend.synchronize, 5),
            **common.ours_settings()}


def gpu_breakdown(solver, backend, iterations: int) -> dict:
    """GPU time per layer type and direction, per iteration: CUDA events recorded on the compute stream around
    each layer's forward and backward (created beforehand and recorded through the driver, ~1 us each, so the
    host is barely slowed). A span covers the layer's kernels and any time the GPU waited for the host inside
    it; 'outside layers' is the rest of the iteration (solver update, clearing diffs, idle gaps)."""
    from cuda.bindings import driver as drv

    stream = drv.CUstream(0)
    nodes = solver.net.graph.nodes
    events = [drv.cuEventCreate(0)[1] for _ in range(8 * len(nodes) * iterations + 2)]  # 4 per layer and iteration, with room
    marks: list = []
    free = iter(events)

    def timed(fn, key, name):
        def run(*args, **kwargs):
            start = next(free)
            drv.cuEventRecord(start, stream)
            fn(*args, **kwargs)
            end = next(free)
            drv.cuEventRecord(end, stream)
            marks.append((key, name, start, end))
        return run

    originals = []
    for node in nodes:
        layer = node.layer
        originals.append((layer, layer.forward, layer.backward))
        layer.forward = timed(layer.forward, layer.type_name + " fwd", f"{node.name} ({layer.type_name}) fwd")
        layer.backward = timed(layer.backward, layer.type_name + " bwd", f"{node.name} ({layer.type_name}) bwd")
    backend.synchronize()
    begin, finish = next(free), next(free)
    drv.cuEventRecord(begin, stream)
    solver.step(iterations)
    drv.cuEventRecord(finish, stream)
    drv.cuEventSynchronize(finish)
    for layer, fwd, bwd in originals:
        layer.forward, layer.backward = fwd, bwd
    spent: dict[str, float] = {}
    per_layer: dict[str, float] = {}
    for key, name, start, end in marks:
        ms = drv.cuEventElapsedTime(start, end)[1]
        spent[key] = spent.get(key, 0.0) + ms
        per_layer[name] = per_layer.get(name, 0.0) + ms
    total = drv.cuEventElapsedTime(begin, finish)[1]
    for e in events:
        drv.cuEventDestroy(e)
    out = {k: round(v / iterations, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    out["all layers"] = round(sum(spent.values()) / iterations, 3)
    out["outside layers"] = round((total - sum(spent.values())) / iterations, 3)
    out["iteration"] = round(total / iterations, 3)
    top = sorted(per_layer.items(), key=lambda kv: -kv[1])[:TOP_LAYERS]
    out["slowest layers"] = {name: round(ms / iterations, 3) for name, ms in top}
    return out


def conv_paths() -> dict:
    """How many (shape, direction) convolution setups run on cuDNN's graph API and how many on the legacy one."""
    from superneurons.backend.cuda.device import current

    counts = {"graph": 0, "legacy": 0}
    for plan in current().cudnn._convs.values():
        for runner in plan.tables:
            if runner is not None:
                counts["graph" if runner.graph else "legacy"] += 1
    return counts


def host_functions(solver, backend, iterations: int, top: int = HOST_FUNCTIONS) -> list[dict]:
    """Where the host's time goes, by Python function (cProfile over `iterations` solver steps, which it
    slows, so read shares, not absolute times): the `top` functions by own time, per iteration."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    backend.synchronize()
    profiler.enable()
    solver.step(iterations)
    backend.synchronize()
    profiler.disable()
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": round(calls / iterations, 1),
             "own_ms": round(1e3 * own / iterations, 3), "cumulative_ms": round(1e3 * cumulative / iterations, 3)}
            for (file, line, name), (_prim, calls, own, cumulative, _callers) in rows]


def host_breakdown(solver, backend, iterations: int) -> dict:
    """Host time (no device synchronization) spent issuing each layer type's forward and backward, per
    iteration. When their sum is close to the iteration time, the run is bound by the host, not the GPU."""
    spent: dict[str, float] = {}

    def timed(fn, key):
        def run(*args, **kwargs):
            t = time.perf_counter()
            fn(*args, **kwargs)
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
        return run

    for node in solver.net.graph.nodes:
        layer = node.layer
        kind = layer.type_name
        layer.forward = timed(layer.forward, kind + " fwd")
        layer.backward = timed(layer.backward, kind + " bwd")
    backend.synchronize()
    t0 = time.perf_counter()
    solver.step(iterations)
    backend.synchronize()
    total = time.perf_counter() - t0
    out = {k: round(1e3 * v / iterations, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    out["all layers"] = round(1e3 * sum(spent.values()) / iterations, 3)
    out["iteration (wall)"] = round(1e3 * total / iterations, 3)
    return out


def kernel_profile(step, synchronize, iterations: int, top: int = KERNELS) -> dict:
    """GPU time per iteration by kernel, the `top` largest: torch.profiler (CUPTI) records every kernel of the
    process, numba's and cuDNN's as well as PyTorch's, so both sides are listed the same way. Never raises:
    the profile is a diagnostic, and a failure is reported in the table instead of losing the timings."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        return {"error": repr(e)}
    try:
        synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iterations):
                step()
            synchronize()
    except Exception as e:
        return {"error": repr(e)}
    def device_us(e) -> float:
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0)

    rows = [(e.key, device_us(e) / 1e3 / iterations) for e in prof.key_averages() if device_us(e) > 0]
    rows.sort(key=lambda kv: -kv[1])
    out = {name[:100]: round(ms, 3) for name, ms in rows[:top]}
    out["all kernels"] = round(sum(ms for _n, ms in rows), 3)
    return out


def pytorch(net: str, batch: int, warmup: int, iterations: int, benchmark: bool, source: str,
            profile: bool = False, config: str = "fp32") -> dict:
    import torch

    in_force = torch_nets.settings(benchmark, None)
    tr = torch_nets.Trainer(net, "plain", batch, source, config)
    tr.set_batch(batch)
    timing = common.time_loop(tr.step, torch.cuda.synchronize, warmup, iterations)
    out = {"img_per_s": batch * iterations / timing["seconds"], "ms_per_iter": timing["ms_per_iter"],
           "source": tr.source, "config": config, **in_force}
    if profile:
        out["gpu_ms_per_iter_by_kernel"] = kernel_profile(tr.step, torch.cuda.synchronize, 5)
        print_kernels(f"PyTorch ({source}, {config})", out["gpu_ms_per_iter_by_kernel"])
    del tr
    torch.cuda.empty_cache()
    return out


def print_kernels(who: str, table: dict) -> None:
    print(f"{who} GPU ms per iteration by kernel (torch.profiler):", flush=True)
    for name, ms in table.items():
        print(f"  {ms:8.3f}  {name}" if isinstance(ms, float) else f"  {name}: {ms}", flush=True)


def torch_sources(net: str, choice: str) -> list[str]:
    """The PyTorch models to time: the same prototxt first, then torchvision's where it has the net."""
    has_tv = bool(common.NETS[net].torchvision)
    if choice == "torchvision" and not has_tv:
        raise SystemExit(f"--torch-source torchvision: torchvision has no model of {net}")
    return {"prototxt": ["prototxt"], "torchvision": ["torchvision"],
            "both": ["prototxt"] + (["torchvision"] if has_tv else [])}[choice]


def versions() -> dict:
    import importlib.metadata as md

    v = {"python": platform.python_version()}
    for d in ("numpy", "numba", "numba-cuda", "cuda-bindings", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "torch",
              "torchvision"):
        try:
            v[d] = md.version(d)
        except md.PackageNotFoundError:
            pass
    try:
        from superneurons.backend.cuda import cudnn

        v["cudnn_runtime"] = cudnn.version()
    except Exception:
        pass
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default="resnet50", help="a net of the speed table (default %(default)s)")
    ap.add_argument("--torch-source", choices=("both", "prototxt", "torchvision"), default="both",
                    help="PyTorch's model: built from the same prototxt, torchvision's, or both (default %(default)s; "
                         "torchvision only where it has the net)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--label", default="", help="a name for this configuration of ours (goes into the JSON)")
    ap.add_argument("--no-torch", action="store_true", help="time only SuperNeurons")
    ap.add_argument("--no-ours", action="store_true", help="time only PyTorch")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                    help="ours' storage of activations and gradients (default: the prototxt's, float32)")
    ap.add_argument("--torch-config", default="fp32", choices=sorted(torch_nets.TORCH_CONFIGS),
                    help="how PyTorch runs (tools/bench/torch_nets.py TORCH_CONFIGS; default %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    common.parse_nets(args.net)  # a known net, or one line naming the known ones
    env = {k: v for k, v in os.environ.items() if k.startswith("SUPERNEURONS_")}
    result = {"net": args.net, "batch": args.batch, "warmup": args.warmup, "iterations": args.iterations, "label": args.label,
              "precision": args.precision or "prototxt",
              "env": env}
    if not args.no_ours:
        result["superneurons"] = ours(args.net, args.batch, args.warmup, args.iterations, args.precision)
        print(f"superneurons losses: {[round(v, 4) for v in result['superneurons']['losses']]}", flush=True)
        print(f"host ms per iteration (no sync): {result['superneurons']['host_ms_per_iter']}", flush=True)
        print("host functions by own time (cProfile, ms per iteration, calls per iteration):", flush=True)
        for row in result['superneurons']['host_functions']:
            print(f"  {row['own_ms']:8.3f} {row['cumulative_ms']:9.3f} {row['calls']:8.1f}  {row['function']}", flush=True)
        profile = dict(result['superneurons']['gpu_ms_per_iter'])
        slowest = profile.pop("slowest layers", {})
        print(f"GPU ms per iteration (events around layers): {profile}", flush=True)
        print("slowest layers (GPU ms per iteration): " + "; ".join(f"{k} {v}" for k, v in slowest.items()), flush=True)
        print(f"convolution directions by cuDNN API: {result['superneurons']['conv_paths']}", flush=True)
        print_kernels("ours", result['superneurons']['gpu_ms_per_iter_by_kernel'])
    if not args.no_torch:
        result["pytorch"] = {}
        for k, source in enumerate(torch_sources(args.net, args.torch_source)):
            for on in (True, False):
                result["pytorch"][f"{source} {args.torch_config}, benchmark {'on' if on else 'off'}"] = pytorch(
                    args.net, args.batch, 10, args.iterations, on, source, profile=on and k == 0,
                    config=args.torch_config)
    try:
        import torch

        result["device"] = torch.cuda.get_device_name(0)
    except Exception:
        from numba import cuda

        result["device"] = cuda.get_current_device().name.decode()
    result["versions"] = versions()
    rows = []
    sn = result.get("superneurons", {}).get("img_per_s")
    for key, pt_result in result.get("pytorch", {"-": {}}).items():
        pt = pt_result.get("img_per_s")
        rows.append((key, sn, pt, sn / pt if sn and pt else None))
    print(f"\n{args.net} training, batch {args.batch}, {args.iterations} timed iterations on {result['device']}"
          f" ({args.label or 'default'})")
    tf32 = result.get("superneurons", {}).get("tf32_convolutions")
    if tf32 is not None:
        print(f"ours: TF32 convolutions {'on' if tf32 else 'off'}, GEMM in FP32, algorithms by "
              f"{result['superneurons']['algorithm_choice']}")
    for key, pt_result in result.get("pytorch", {}).items():
        print(f"PyTorch {key}: cudnn.allow_tf32 {pt_result['cudnn_allow_tf32']}, "
              f"matmul.allow_tf32 {pt_result['matmul_allow_tf32']}")
    print(f"{'PyTorch model, cudnn.benchmark':<34} {'ours img/s':>11} {'PyTorch img/s':>14} {'ratio':>7}")
    for name, a, b, r in rows:
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{name:<34} {f(a, '11.1f')} {f(b, '14.1f')} {f(r, '7.3f')}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_{args.net}{'_' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
