"""`superneurons convert IN OUT`: rewrite an old Caffe net, solver or .caffemodel in the current format."""
from __future__ import annotations

import argparse
import os

from google.protobuf import message, text_format

from superneurons.commands._options import add_command
from superneurons.errors import UserError
from superneurons.io.prototxt import parse_text, read_binary, write_binary, write_text
from superneurons.io.upgrade import upgrade_net, upgrade_solver
from superneurons.proto import superneurons_pb2 as pb

EXAMPLES = """examples:
  superneurons convert lenet_v1.prototxt lenet.prototxt           # V0/V1 net -> current text prototxt
  superneurons convert old_solver.prototxt solver.prototxt        # solver_type: NESTEROV -> type: "Nesterov"
  superneurons convert alexnet_v1.caffemodel alexnet.caffemodel   # V1 weights -> current binary caffemodel
  superneurons convert alexnet.caffemodel alexnet.txt --text      # look inside a caffemodel (large!)

What is upgraded: V0 and V1 layers (enum types, blobs_lr/weight_decay -> param { lr_mult decay_mult },
shared param names, blobs), net-level input/input_dim/input_shape -> an Input layer, data layers'
scale/mean_file/crop_size/mirror -> transform_param, pooling ceil_mode -> round_mode, and a
solver's solver_type -> type. A text file is a net if it parses as one, else a solver; a
.caffemodel (or any file that is not UTF-8 text) is a binary net. The output is written by
protobuf's printer: comments and layout of a text input are not kept. OUT may equal IN.
"""


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "convert", run,
                    help="upgrade an old (V0/V1) net, solver or .caffemodel to the current format",
                    description="Upgrade a Caffe net prototxt, solver prototxt or .caffemodel written in an "
                                "older format to the current one, and say what changed.",
                    examples=EXAMPLES)
    p.add_argument("input", metavar="IN", help="net or solver prototxt, or a .caffemodel")
    p.add_argument("output", metavar="OUT", help="where to write the current-format file")
    p.add_argument("--text", action="store_true",
                   help="write a .caffemodel input as a text prototxt (weights included) instead of binary")
    return p


def run(args) -> int:
    kind, msg = read_any(args.input)
    notes: list[str] = []
    if kind == "solver":
        upgraded = upgrade_solver(msg, args.input, notes)
    else:
        upgraded = upgrade_net(msg, args.input, notes)
    binary_out = kind == "caffemodel" and not args.text
    (write_binary if binary_out else write_text)(args.output, upgraded)
    what = {"net": "net prototxt", "solver": "solver prototxt", "caffemodel": "caffemodel"}[kind]
    out_format = "binary caffemodel" if binary_out else "text prototxt"
    if notes:
        print(f"{args.input} ({what}) -> {args.output} ({out_format}):")
        for note in notes:
            print(f"  {note}")
    else:
        print(f"{args.input} ({what}) is already in the current format; wrote it to {args.output} ({out_format})")
    return 0


def read_any(path: str) -> tuple[str, message.Message]:
    """("net" | "solver" | "caffemodel", parsed message) for the file at `path`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a prototxt or .caffemodel file") from None
    text = _as_text(path, data)
    if text is None:
        return "caffemodel", read_binary(path, pb.NetParameter())
    return _parse_net_or_solver(path, text)


def _as_text(path: str, data: bytes) -> str | None:
    """The file's text, or None when it is a binary protobuf (by extension, NUL bytes or invalid UTF-8)."""
    if os.path.splitext(path)[1].lower() == ".caffemodel" or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _parse_net_or_solver(path: str, text: str) -> tuple[str, message.Message]:
    failures = []
    for kind, cls in (("net", pb.NetParameter), ("solver", pb.SolverParameter)):
        msg = cls()
        try:
            text_format.Merge(text, msg)
        except text_format.ParseError as e:
            failures.append(((e.GetLine() or 0, e.GetColumn() or 0), cls))
            continue
        if not msg.ListFields():
            raise UserError(f"{path}: the file is empty: no net or solver fields")
        return kind, msg
    # Neither parsed: the kind that got further into the file is the one it was meant to be
    # (max keeps the first, the net, on a tie). Parse it again for the file:line:col message.
    _, cls = max(failures, key=lambda f: f[0])
    parse_text(text, cls(), path)
    raise AssertionError("unreachable: the text failed to parse above")
