"""Stand-in inputs: the shapes of a net whose data is not on this machine (`summary`, `memory`, `time`).

A zoo `train_val.prototxt` names LMDBs that only its author has; its layers' shapes depend only on the
batch's shape. `stand_in_inputs` replaces each data layer whose source is absent, and each input the user
sized with `--input-shape name=N,C,H,W`, by a DummyData layer of that shape (Gaussian data, zero labels), and
returns one line per replaced layer saying which shapes it assumed and why. Shapes come from
`--input-shape` first, else from the layer's own fields: batch_size, crop_size or new_height/new_width,
and the channel count its colour settings imply (3, or 1 for force_gray / is_color: false); a label top
is (N,). What the fields cannot give is an error that names the flag to add.
"""
from __future__ import annotations

import os

from superneurons.errors import UserError
from superneurons.graph.state import is_included
from superneurons.proto import superneurons_pb2 as pb

Shape = tuple[int, ...]


def parse_input_shapes(values: list[str] | None) -> dict[str, Shape]:
    """['data=10,3,227,227', 'label=10'] -> {'data': (10, 3, 227, 227), 'label': (10,)}."""
    shapes: dict[str, Shape] = {}
    for text in values or ():
        name, sep, dims = text.partition("=")
        pieces = dims.replace("x", ",").split(",")  # 10,3,227,227 or 10x3x227x227
        shape = tuple(int(d) for d in pieces) if all(d.strip().isdigit() for d in pieces) else ()
        if not sep or not name.strip() or not shape or any(d <= 0 for d in shape):
            raise UserError(f"--input-shape {text!r}: expected BLOB=N,C,H,W with positive sizes, "
                            "e.g. data=10,3,227,227")
        shapes[name.strip()] = shape
    return shapes


def _source_and_image(layer: pb.LayerParameter) -> tuple[str, int, int, Shape | None, str] | None:
    """(source, batch size, channels, (height, width) or None, how the image size was found) of a data
    layer that reads a file, else None."""
    tp = layer.transform_param
    crop = int(tp.crop_size)
    gray = bool(tp.force_gray)
    if layer.type == "Data":
        p = layer.data_param
        hw, how = ((crop, crop), f"crop_size {crop}") if crop else (None, "")
        return p.source, int(p.batch_size), 1 if gray else 3, hw, how
    if layer.type == "ImageData":
        p = layer.image_data_param
        if crop:
            hw, how = (crop, crop), f"crop_size {crop}"
        elif p.new_height and p.new_width:
            hw, how = (int(p.new_height), int(p.new_width)), f"new_height/new_width {p.new_height}x{p.new_width}"
        else:
            hw, how = None, ""
        return p.source, int(p.batch_size), 3 if p.is_color else 1, hw, how
    if layer.type == "WindowData":
        p = layer.window_data_param
        size = crop or int(p.crop_size)
        hw, how = ((size, size), f"crop_size {size}") if size else (None, "")
        return p.source, int(p.batch_size), 3, hw, how
    if layer.type == "HDF5Data":  # an HDF5 file's datasets carry their shapes; the prototxt does not
        p = layer.hdf5_data_param
        return p.source, int(p.batch_size), 0, None, ""
    return None


def _fmt(shape: Shape) -> str:
    return "x".join(str(d) for d in shape)


def stand_in_inputs(net: pb.NetParameter, input_shapes: dict[str, Shape], where: str,
                    state: pb.NetState | None = None, batch: int | None = None) -> list[str]:
    """Replace, in place, the data layers of `net` that cannot be read here or that `input_shapes` sizes
    (only those of `state`'s net when given: the other phase's layers are never built); returns what was
    assumed, one line per layer. `batch`: the --batch that will replace every batch_size (said as such)."""
    notes: list[str] = []
    used: set[str] = set()
    for i, layer in enumerate(net.layer):
        if state is not None and not is_included(layer, state):
            continue
        tops = list(layer.top)
        if layer.type == "Input" and any(t in input_shapes for t in tops):
            shapes = list(layer.input_param.shape)
            given = [tuple(s.dim) for s in shapes] * (len(tops) if len(shapes) == 1 else 1)
            layer.input_param.ClearField("shape")
            for t, old in zip(tops, given + [()] * len(tops)):
                layer.input_param.shape.add().dim.extend(input_shapes.get(t, old))
            used.update(t for t in tops if t in input_shapes)
            notes.append(f"layer {layer.name!r} (Input): " + ", ".join(
                f"{t} {_fmt(input_shapes[t])} (--input-shape)" for t in tops if t in input_shapes))
            continue
        found = _source_and_image(layer)
        if found is None:
            continue
        source, batch_size, channels, hw, how = found
        n_items, said_n = (batch, f"--batch {batch}") if batch else (batch_size, f"batch_size {batch_size}")
        absent = not source or not os.path.exists(source)
        if not absent and not any(t in input_shapes for t in tops):
            continue
        shapes, whys = [], []
        for j, t in enumerate(tops):
            if t in input_shapes:
                shapes.append(input_shapes[t])
                whys.append(f"{t} {_fmt(input_shapes[t])} (--input-shape)")
                used.add(t)
            elif j == 1 and layer.type != "HDF5Data":  # labels: one per item of the data top
                n = shapes[0][0] if tops[0] in input_shapes else n_items
                shapes.append((n,))
                whys.append(f"{t} {n} ({'as ' + tops[0] if tops[0] in input_shapes else said_n.split(' ')[0]})")
            elif j == 0 and hw is not None and n_items > 0:
                shapes.append((n_items, channels) + hw)
                whys.append(f"{t} {_fmt(shapes[-1])} ({said_n}, {channels} channels, {how})")
            else:
                reason = f"its source {source!r} does not exist here" if absent else "--input-shape sizes another top"
                raise UserError(f"{where}: layer {layer.name!r} ({layer.type}): {reason} and the prototxt does not "
                                f"give the shape of top {t!r}; add --input-shape {t}=N,C,H,W")
        said = f"source {source!r} not found" if absent else "sized on the command line"
        notes.append(f"layer {layer.name!r} ({layer.type}, {said}): assumed " + ", ".join(whys))
        net.layer[i].CopyFrom(_dummy(layer, shapes))
    unknown = sorted(set(input_shapes) - used)
    if unknown:
        inputs = sorted({t for layer in net.layer if layer.type in ("Input", "DummyData") or
                         _source_and_image(layer) is not None for t in layer.top})
        raise UserError(f"{where}: --input-shape names {', '.join(map(repr, unknown))}, which no input layer "
                        f"produces (inputs: {', '.join(inputs) or 'none'})")
    return notes


def _dummy(layer: pb.LayerParameter, shapes: list[Shape]) -> pb.LayerParameter:
    """A DummyData layer with `layer`'s name, tops and phase rules: Gaussian data, zero labels."""
    out = pb.LayerParameter(name=layer.name, type="DummyData", top=list(layer.top))
    out.include.extend(layer.include)
    out.exclude.extend(layer.exclude)
    for j, shape in enumerate(shapes):
        out.dummy_data_param.shape.add().dim.extend(shape)
        filler = out.dummy_data_param.data_filler.add()
        if j == 0:
            filler.type, filler.std = "gaussian", 1.0
        else:
            filler.type, filler.value = "constant", 0.0
    return out
