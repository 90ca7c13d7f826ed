"""Where the host time of one cuDNN convolution call goes: cuDNN itself against our Python around it.

    python3 -m tools.bench.conv_overhead [--calls 20] [--repeats 25] [--out DIR]

Host time only: each measurement issues `--calls` calls back to back with no synchronization, then waits for
the GPU outside the clock, `--repeats` times; the table shows the median microseconds per call. Measured on
ResNet-50 shapes at batch 64 (TF32 allowed, as training runs), per direction:

  legacy (as called before)  cudnnConvolution* through an untyped ctypes function looked up on the CDLL per call,
                             with c_void_p/byref conversions (what ConvPlan._run issued before this change)
  legacy (bound)             the same cuDNN call, bound once with argtypes, all arguments precomputed
  graph execute              cudnnBackendExecute of a prebuilt execution plan with a cached variant pack
  graph + new pack           the same, building and finalizing the variant pack in each call
  ours (whole call)          ops.conv_forward / conv_backward as the layers call them now (pick, workspace from a
                             PoolWorkspace over a HeapPool, pointers, execute)
  GPU                        device time per call (with synchronization), for scale

and the Python pieces around a call, before and after this change. Also checks that the graph path computes what
the legacy path does. Prints the tables last and writes conv_overhead.json to --out (default $OUT or .).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

# (name, x shape, output channels, kernel, stride, pad): ResNet-50 (Caffe's), batch 64
SHAPES = [
    ("conv1 7x7/2", (64, 3, 224, 224), 64, 7, 2, 3),
    ("res2 1x1 64->256", (64, 64, 56, 56), 256, 1, 1, 0),
    ("res2 3x3 64", (64, 64, 56, 56), 64, 3, 1, 1),
    ("res4 1x1 1024->256", (64, 1024, 14, 14), 256, 1, 1, 0),
    ("res5 3x3 512", (64, 512, 7, 7), 512, 3, 1, 1),
]
DIRECTIONS = ("fwd", "bwd data", "bwd filter")


def host_us(fn, calls: int, repeats: int, sync) -> float:
    """Median host microseconds per call of `fn` over `repeats` bursts of `calls` calls (GPU drained between)."""
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
        sync()
    return 1e6 * statistics.median(samples)


def device_us(fn, calls: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    from numba import cuda

    from superneurons.backend.cuda import CudaBackend, cudnn, cudnn_graph, libs
    from superneurons.backend.cuda.device import current, pointer
    from superneurons.backend.geometry import ConvGeometry
    from superneurons.memory.pool import HeapPool
    from superneurons.memory.workspace import PoolWorkspace

    backend = CudaBackend(0)
    sync = backend.synchronize
    h = current().cudnn
    pool = HeapPool(3 << 30, backend)
    for i in range(8):  # a few tensors and holes, as the Net's pool has
        pool.alloc(f"t{i}", (i + 1) << 20)
    for i in range(0, 8, 2):
        pool.free(f"t{i}")
    source = PoolWorkspace(pool)
    backend.set_workspace_source(source)
    raw = ctypes.CDLL(libs.path_of(libs.load("cudnn")))  # a second handle: its functions have no argtypes
    rng = np.random.default_rng(0)

    def device(shape):
        return cuda.to_device((rng.standard_normal(shape) * 0.1).astype(np.float32))

    rows, checks = [], []
    for name, xs, m, k, s, p in SHAPES:
        geom = ConvGeometry((k, k), (s, s), (p, p), (1, 1), 1)
        oh, ow = geom.out_size(xs[2:])
        ys, ws_ = (xs[0], m, oh, ow), (m, xs[1], k, k)
        x, w, y, dy = device(xs), device(ws_), device(ys), device(ys)
        dx, dw = device(xs), device(ws_)
        plan = h.conv_plan(xs, ws_, ys, geom, np.dtype(np.float32))
        operands = ((x, w, y), (w, dy, dx), (x, dy, dw))
        calls_ours = (lambda: backend.ops.conv_forward(x, w, None, y, geom),
                      lambda: backend.ops.conv_backward(x, w, dy, dx, None, None, geom),
                      lambda: backend.ops.conv_backward(x, w, dy, None, dw, None, geom))
        for d in range(3):
            calls_ours[d]()  # sets the direction up (graph plan or legacy table)
            ptrs = tuple(pointer(a) for a in operands[d])
            legacy = plan.legacy(d, ptrs)
            lchoice = legacy.pick(source.available())
            lws = source.acquire(lchoice.workspace) if lchoice.workspace else 0
            descs = plan.descriptors(d)
            beta = ctypes.byref(ctypes.c_float(1.0 if d == cudnn.BACKWARD_FILTER else 0.0))
            one = ctypes.byref(ctypes.c_float(1.0))
            fname = cudnn._FUNCTIONS[d][2]
            plan._set_math(lchoice.math)

            def legacy_old():
                a, b, o = operands[d]
                status = getattr(raw, fname)(
                    h.value, one, descs[0], ctypes.c_void_p(a.device_ctypes_pointer.value), descs[1],
                    ctypes.c_void_p(b.device_ctypes_pointer.value), plan.conv, lchoice.algo, ctypes.c_void_p(lws),
                    ctypes.c_size_t(lchoice.workspace), beta, descs[2], ctypes.c_void_p(o.device_ctypes_pointer.value))
                assert status == 0, status

            def legacy_bound():
                legacy.execute(lchoice, *ptrs, lws)

            row = {"shape": name, "direction": DIRECTIONS[d], "legacy_algo": lchoice.algo,
                   "legacy_workspace": lchoice.workspace}
            row["legacy (as called before)"] = host_us(legacy_old, args.calls, args.repeats, sync)
            row["legacy (bound)"] = host_us(legacy_bound, args.calls, args.repeats, sync)
            gpu_legacy = device_us(legacy_bound, args.calls, sync)
            if lws:
                source.release()
            runner = plan.tables[d]
            if runner.graph:
                gplan = runner.pick(source.available())
                gws = source.acquire(gplan.workspace) if gplan.workspace else 0
                row["graph_engine"], row["graph_workspace"] = gplan.engine, gplan.workspace

                def graph_execute():
                    gplan.execute(runner.handle, *ptrs, gws)

                def graph_new_pack():
                    gplan._packs.clear()
                    gplan.execute(runner.handle, *ptrs, gws)

                row["graph execute"] = host_us(graph_execute, args.calls, args.repeats, sync)
                row["graph + new pack"] = host_us(graph_new_pack, args.calls, args.repeats, sync)
                row["GPU graph"] = device_us(graph_execute, args.calls, sync)
                if gws:
                    source.release()
                if d == cudnn.FORWARD:  # the graph path computes what the legacy one does
                    graph_execute()
                    got = y.copy_to_host()
                    legacy_bound()
                    want = y.copy_to_host()
                    checks.append({"shape": name, "max_abs_diff": float(np.abs(got - want).max()),
                                   "scale": float(np.abs(want).max())})
            row["ours (whole call)"] = host_us(calls_ours[d], args.calls, args.repeats, sync)
            row["GPU legacy"] = gpu_legacy
            rows.append(row)

    # -- the Python pieces around one call, before and after ----------------------------------------------
    x = device((64, 64, 56, 56))
    lib = libs.load("cudnn")
    table = cudnn.AlgoTable([cudnn.AlgoChoice(1, 64 << 20, 0), cudnn.AlgoChoice(0, 0, 0)], measured=False)
    n = 2000

    def per_call(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return 1e6 * (time.perf_counter() - t0) / n

    def old_acquire():  # the workspace as PoolWorkspace handed it out before: a numba view per call
        pool.alloc("#ws", 32 << 20)
        cudnn_ptr = pool.view("#ws", (32 << 20,), np.uint8).device_ctypes_pointer.value
        pool.free("#ws")
        return cudnn_ptr

    def old_pick():  # AlgoTable.pick before: a dict keyed by the exact available bytes
        cache = old_pick.__dict__.setdefault("cache", {})
        got = cache.get(source.available())
        if got is None:
            cache[source.available()] = table.items[0]

    pieces = {
        "ctypes call (cudnnGetVersion, bound)": per_call(cudnn.version),
        "3 x c_void_p(a.device_ctypes_pointer.value) (before)":
            per_call(lambda: [ctypes.c_void_p(x.device_ctypes_pointer.value) for _ in range(3)]),
        "3 x device.pointer(a) (now: cached on the array)": per_call(lambda: [pointer(x) for _ in range(3)]),
        "getattr(CDLL, name) per call (before)": per_call(lambda: getattr(lib, "cudnnConvolutionForward")),
        "source.available() (PoolWorkspace: largest free extent)": per_call(source.available),
        "pick by exact available bytes (before)": per_call(old_pick),
        "pick with the cached interval (now)": per_call(lambda: table.pick(source.available())),
        "acquire + release, numba view per call (before)": per_call(old_acquire),
        "acquire + release, arena base + offset (now)": per_call(lambda: (source.acquire(32 << 20),
                                                                           source.release())),
    }

    cols = ["legacy (as called before)", "legacy (bound)", "graph execute", "graph + new pack", "ours (whole call)",
            "GPU legacy", "GPU graph"]
    print(f"\ncuDNN {cudnn.version()}, host microseconds per call (median of {args.repeats} bursts of {args.calls};"
          f" GPU columns: device time per call)")
    print(f"{'shape':<20} {'dir':<10} " + " ".join(f"{c[:16]:>16}" for c in cols))
    for r in rows:
        print(f"{r['shape']:<20} {r['direction']:<10} "
              + " ".join(f"{r[c]:16.1f}" if c in r else f"{'-':>16}" for c in cols))
    mean = {c: statistics.mean(r[c] for r in rows if c in r) for c in cols if any(c in r for r in rows)}
    print(f"{'mean':<31} " + " ".join(f"{mean[c]:16.1f}" if c in mean else f"{'-':>16}" for c in cols))
    print("\nPython pieces around one call, microseconds")
    for k, v in pieces.items():
        print(f"  {k:<58} {v:8.2f}")
    for c in checks:
        print(f"graph vs legacy forward, {c['shape']}: max |diff| {c['max_abs_diff']:.2e} (max |y| {c['scale']:.2e})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "conv_overhead.json").write_text(json.dumps({"rows": rows, "mean": mean, "pieces": pieces,
                                                        "checks": checks, "cudnn": cudnn.version(),
                                                        "graph_enabled": cudnn_graph.enabled()}, indent=1))
    print(f"wrote {out / 'conv_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
