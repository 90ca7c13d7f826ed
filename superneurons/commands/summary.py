"""`superneurons summary`: the net's layers, wiring, shapes and parameter counts as a table."""
from __future__ import annotations

import argparse

from superneurons.commands._options import add_command, add_input_options, add_net_state_options, read_model, split_stages
from superneurons.graph.build import build_graph
from superneurons.layers.base import count
from superneurons.memory.pool import format_bytes
from superneurons.proto import superneurons_pb2 as pb

EXAMPLES = """examples:
  superneurons summary --model models/lenet/lenet_train_test.prototxt
  superneurons summary --model ResNet-50-deploy.prototxt --batch 32 --phase TEST
  superneurons summary --model bvlc_alexnet/train_val.prototxt     # no LMDB here: shapes from crop_size
  superneurons summary --model train_val.prototxt --input-shape data=32,3,224,224

A data layer whose source is not on this machine is sized from its own fields (batch_size, crop_size,
new_height/new_width) or from --input-shape; the lines on stderr say which shapes were assumed.
"""


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "summary", run,
                    help="print a net's layers, top shapes and parameter counts",
                    examples=EXAMPLES)
    p.add_argument("--model", required=True, help="net prototxt")
    p.add_argument("--phase", choices=["TRAIN", "TEST"], default="TRAIN")
    add_input_options(p)
    add_net_state_options(p)
    return p


def run(args) -> int:
    net = read_model(args)
    graph = build_graph(net, pb.Phase.Value(args.phase), args.level, tuple(split_stages(args.stage)),
                        source=args.model)
    print(format_summary(graph))
    return 0


def _shape(s) -> str:
    return " ".join(str(d) for d in s) if s else "scalar"


def format_summary(graph) -> str:
    rows = [("layer", "type", "bottoms", "tops", "top shapes", "params")]
    n_params = 0
    act_bytes = 0
    seen = set()
    for node in graph.nodes:
        layer = node.layer
        params = ", ".join(_shape(d.shape) for d in layer.params) or "-"
        n_params += sum(count(d.shape) for d in layer.params)
        for t, s in zip(node.tops, node.top_shapes):
            if t not in seen:
                seen.add(t)
                act_bytes += 4 * count(s)
        rows.append((layer.name, layer.type_name, ",".join(node.bottoms) or "-", ",".join(node.tops),
                     "; ".join(_shape(s) for s in node.top_shapes), params))
    widths = [min(40, max(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    lines = [f"Net {graph.name!r} ({pb.Phase.Name(graph.phase)}), {len(graph.nodes)} layers"]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"Parameters: {n_params:,} ({format_bytes(4 * n_params)})")
    lines.append(f"Activations (one copy of every top, float32): {format_bytes(act_bytes)}")
    lines.append(f"Outputs: {', '.join(graph.outputs)}")
    return "\n".join(lines)
