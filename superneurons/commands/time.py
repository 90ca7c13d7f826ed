"""`superneurons time`: Caffe's built-in profiler, plus memory per step and the runtime's share of the time.

Besides Caffe's lines it shows, per layer, the live pool bytes after each step and what the memory
manager did at its forward (F) and backward (B) steps, averaged per iteration: tensors allocated and
freed, bytes offloaded to and prefetched from the host, forward steps recomputed, Tensor Cache hits
and misses. `--memory liveness|offload|recompute|auto` times the net under that manager.

As `caffe time`, every layer's backward is timed: a net without a loss (a deploy net) is run as if its
outputs fed a loss of weight 1, so every layer below them runs backward. A net whose data is not on
this machine runs on stand-in inputs of the shapes its prototxt or --input-shape gives.
"""
from __future__ import annotations

import argparse
import json
import sys

from superneurons.commands._options import (add_command, add_device_options, add_input_options, add_net_state_options,
                                             add_precision_option, net_state, pick_backend, read_model, split_stages)
from superneurons.errors import UserError
from superneurons.graph.build import Graph, build_graph
from superneurons.graph.precision import override_defaults
from superneurons.graph.state import is_included
from superneurons.memory import recurrent_input
from superneurons.memory.pool import format_bytes, parse_size
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from superneurons.runtime.profiler import MEMORY_COUNTERS, Profiler

EXAMPLES = """examples:
  superneurons time --model models/lenet/lenet_train_test.prototxt --iterations 20
  superneurons time --model models/lenet/lenet_train_test.prototxt --memory recompute --iterations 10
  superneurons time --model resnet50_dummy.prototxt --gpu 0 --memory recompute --gpu-memory 12G --json
  superneurons time -model deploy.prototxt -gpu 0 -iterations 10 --input-shape data=64,3,224,224
"""


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "time", run,
                    help="time each layer's forward and backward pass, with memory per step",
                    examples=EXAMPLES)
    p.add_argument("--model", required=True, help="net prototxt")
    p.add_argument("--iterations", type=int, default=50, help="timed iterations after one warm-up (default 50)")
    p.add_argument("--phase", choices=["TRAIN", "TEST"], default="TRAIN",
                   help="which phase's layers to time (default TRAIN, as Caffe); backward runs in both")
    add_net_state_options(p)
    add_input_options(p)
    add_precision_option(p)
    p.add_argument("--json", action="store_true", help="print the measurements as JSON instead of a table")
    p.add_argument("--weights", help="initialise from a .caffemodel")
    add_device_options(p)
    return p


def run(args) -> int:
    if args.iterations <= 0:
        raise UserError(f"--iterations must be positive, got {args.iterations}")
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    net_param = override_defaults(read_model(args, say), args.precision)

    def build() -> Graph:
        return build_graph(net_param, pb.Phase.Value(args.phase), args.level, tuple(split_stages(args.stage)),
                           source=args.model, recurrent_input=recurrent_input(args.memory))

    graph = build()
    if not graph.loss_blobs:
        outputs = seed_outputs_as_loss(net_param, graph, net_state(args, net_param))
        say(f"{args.model}: no loss in the net: timing backward as if {', '.join(outputs)} fed a loss of weight 1 "
            "(caffe time runs every layer's backward)")
        graph = build()
    backend = pick_backend(args.gpu)
    net = Net(graph, backend, train=True, seed=1, memory=args.memory, pool_bytes=parse_size(args.gpu_memory),
              data_workers=args.data_workers)
    if args.weights:
        from superneurons.io.caffemodel import load_weights

        load_weights(net, args.weights)
    # Caffe's blobs start at zero; the pool's memory holds whatever was there, and timing on it can meet
    # overflows and NaNs (slow paths on the CPU). The Input layers' tops are all nobody writes.
    graph = net.graph  # auto may run recurrent layers in another form than built (memory.recurrent_input)
    for node in graph.nodes:
        if node.layer.type_name == "Input":
            for top in node.tops:
                net.ops.fill(net.data[top].array, 0.0)
    profile = Profiler(net).run(args.iterations)
    if args.json:
        print(json.dumps(to_json(profile, graph.name, args), indent=1))
    else:
        print(format_table(profile, args.iterations))
    return 0


def seed_outputs_as_loss(net_param: pb.NetParameter, graph: Graph, state: pb.NetState) -> list[str]:
    """Give each output blob of `graph` loss_weight 1 on the last layer of `state`'s net that writes it, so
    the net has a loss and every layer upstream of an output needs backward; returns the outputs."""
    outputs = list(graph.outputs)
    last_writer = {}
    for i, layer in enumerate(net_param.layer):
        if not is_included(layer, state):
            continue
        for j, top in enumerate(layer.top):
            if top in outputs:
                last_writer[top] = (i, j)
    for top, (i, j) in last_writer.items():
        layer = net_param.layer[i]
        if not len(layer.loss_weight):
            layer.loss_weight.extend([0.0] * len(layer.top))
        layer.loss_weight[j] = 1.0
    return outputs


def to_json(profile, name: str, args) -> dict:
    n = max(1, profile.iterations)
    per_iter = lambda actions: {k: v / n for k, v in actions.items()}  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {
        "net": name, "iterations": args.iterations, "memory": args.memory, "memory_mode": profile.memory_mode,
        "layers": [{"name": t.name, "type": t.type, "forward_ms": t.forward_avg, "backward_ms": t.backward_avg,
                    "forward_live_bytes": t.forward_live_bytes, "backward_live_bytes": t.backward_live_bytes,
                    "algo": t.algo,
                    "forward_memory_ms": mean(t.forward_memory_ms), "backward_memory_ms": mean(t.backward_memory_ms),
                    "replay_ms": t.replay_ms / n, "layout_conversions": t.layout_conversions / n,
                    "forward_actions": per_iter(t.forward_actions),
                    "backward_actions": per_iter(t.backward_actions)} for t in profile.layers],
        "summary": profile.summary(), "peak_bytes": profile.peak_bytes, "pool_bytes": profile.pool_bytes,
    }


_ACTION_WORDS = {"allocs": "alloc", "frees": "free", "bytes_offloaded": "offload", "bytes_prefetched": "prefetch",
                 "replays": "recompute", "hits": "hit", "misses": "miss"}


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def format_actions(actions: dict[str, int], iterations: int) -> str:
    """'alloc 2, offload 1.5 MiB, recompute 3, miss 1': one step's counters per iteration; '' when idle."""
    n = max(1, iterations)
    parts = []
    for k in MEMORY_COUNTERS:
        v = actions.get(k, 0) / n
        if v:
            parts.append(f"{_ACTION_WORDS[k]} {format_bytes(int(round(v))) if k.startswith('bytes_') else _count(v)}")
    return ", ".join(parts)


def memory_column(t, iterations: int) -> str:
    f, b = format_actions(t.forward_actions, iterations), format_actions(t.backward_actions, iterations)
    parts = ([f"F: {f}"] if f else []) + ([f"B: {b}"] if b else [])
    if t.layout_conversions:  # op calls that converted NCHW <-> NHWC arrays (graph/layout.py)
        parts.append(f"layout conversions {_count(t.layout_conversions / max(1, iterations))}")
    return "; ".join(parts) or "-"


def format_table(profile, iterations: int) -> str:
    s = profile.summary()
    width = max([5] + [len(t.name) for t in profile.layers])
    algo_w = max([4] + [len(t.algo or "-") for t in profile.layers])
    lines = [f"{'layer':<{width}}  {'type':<16} {'forward ms':>11} {'backward ms':>12} "
             f"{'live fwd':>11} {'live bwd':>11}  {'algo':<{algo_w}}  {'memory ms':>9}  memory actions (per iteration)"]
    for t in profile.layers:
        bwd = f"{t.backward_avg:12.4f}" if t.backward_ms else f"{'-':>12}"
        live_b = format_bytes(t.backward_live_bytes) if t.backward_ms else "-"
        lines.append(f"{t.name:<{width}}  {t.type:<16} {t.forward_avg:11.4f} {bwd} "
                     f"{format_bytes(t.forward_live_bytes):>11} {live_b:>11}  {t.algo or '-':<{algo_w}}  "
                     f"{t.memory_avg:9.4f}  {memory_column(t, profile.iterations)}")
    lines += [
        f"Average Forward pass: {s['forward_ms']:.4f} ms.",
        f"Average Backward pass: {s['backward_ms']:.4f} ms.",
        f"Average Forward-Backward: {s['forward_backward_ms']:.4f} ms.",
        f"Total Time: {s['total_ms']:.4f} ms ({iterations} iterations).",
        f"Sum of layer times: {s['layer_sum_ms']:.4f} ms; runtime bookkeeping outside layers: "
        f"{100 * s['bookkeeping_share']:.1f}% of the iteration.",
        f"Memory runtime (--memory {profile.memory_mode}: manager actions, recomputation included): "
        f"{s['memory_runtime_ms']:.4f} ms, {100 * s['memory_share']:.1f}% of the iteration.",
        f"Peak memory in use: {format_bytes(profile.peak_bytes)} of a {format_bytes(profile.pool_bytes)} pool.",
    ]
    return "\n".join(lines)
