"""Upgrading Caffe's older net and solver files to the current format.

Caffe's net files went through three layouts, and a Caffe user may bring any of them
(prototxts and .caffemodel weights alike):

  V0       layers { layer { name: "conv1" type: "conv" num_output: 96 kernelsize: 11 } bottom: "data" top: "conv1" }
  V1       layers { name: "conv1" type: CONVOLUTION blobs_lr: 1 weight_decay: 1 convolution_param { ... } }
  current  layer  { name: "conv1" type: "Convolution" param { lr_mult: 1 decay_mult: 1 } convolution_param { ... } }

Besides the layer layout, two net-level conventions changed: deploy nets declared their inputs
with `input:` + `input_dim:`/`input_shape:` (now an `Input` layer), and data layers carried
`scale`/`mean_file`/`crop_size`/`mirror` in their own params (now `transform_param`). One fork
convention is accepted too: pooling `ceil_mode: false` (DenseNet/ResNet-18 files) is `round_mode: FLOOR`.
BatchNorm layers' `param { lr_mult: 0 }` blocks, which Caffe strips, are left alone: our BatchNorm's
statistics are not learnable, so no solver reads them.

Everything here is pure: `upgrade_net` and `upgrade_solver` return a new message and leave their
argument alone (or return it unchanged when nothing needs upgrading). A caller that wants to know
what changed (`superneurons convert`) passes a `notes` list, which gets one line per kind of change.
"""
from __future__ import annotations

from typing import Any

from google.protobuf import message

from superneurons.errors import UserError
from superneurons.io.prototxt_lines import layer_line
from superneurons.proto import superneurons_pb2 as pb

V1 = pb.V1LayerParameter

# ---- facts from Caffe's format history ------------------------------------------------------

# V1 layer type enum -> current type string, for every value of V1LayerParameter.LayerType.
V1_TYPE_NAMES: dict[str, str] = {
    "ABSVAL": "AbsVal",
    "ACCURACY": "Accuracy",
    "ARGMAX": "ArgMax",
    "BNLL": "BNLL",
    "CONCAT": "Concat",
    "CONTRASTIVE_LOSS": "ContrastiveLoss",
    "CONVOLUTION": "Convolution",
    "DATA": "Data",
    "DECONVOLUTION": "Deconvolution",
    "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss",
    "ELTWISE": "Eltwise",
    "EXP": "Exp",
    "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data",
    "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss",
    "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss",
    "INNER_PRODUCT": "InnerProduct",
    "LRN": "LRN",
    "MEMORY_DATA": "MemoryData",
    "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN",
    "POOLING": "Pooling",
    "POWER": "Power",
    "RELU": "ReLU",
    "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss",
    "SILENCE": "Silence",
    "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss",
    "SPLIT": "Split",
    "SLICE": "Slice",
    "TANH": "TanH",
    "WINDOW_DATA": "WindowData",
    "THRESHOLD": "Threshold",
}

# V0 type string -> V1 enum name. ("padding" is not here: it is folded into the next conv.)
V0_TYPE_NAMES: dict[str, str] = {
    "accuracy": "ACCURACY",
    "bnll": "BNLL",
    "concat": "CONCAT",
    "conv": "CONVOLUTION",
    "data": "DATA",
    "dropout": "DROPOUT",
    "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN",
    "hdf5_data": "HDF5_DATA",
    "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL",
    "images": "IMAGE_DATA",
    "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT",
    "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS",
    "pool": "POOLING",
    "relu": "RELU",
    "sigmoid": "SIGMOID",
    "softmax": "SOFTMAX",
    "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT",
    "tanh": "TANH",
    "window_data": "WINDOW_DATA",
}

# Where each V0 field goes in a V1 layer, by V0 type; "*" means for any type.
# A target path is "<param message>.<field>"; repeated targets (conv pad/kernel_size/stride) get appended.
_ANY = "*"
_CONV_OR_IP = {"conv": "convolution_param", "innerproduct": "inner_product_param"}
V0_FIELDS: dict[str, dict[str, str]] = {
    "num_output": {t: f"{p}.num_output" for t, p in _CONV_OR_IP.items()},
    "biasterm": {t: f"{p}.bias_term" for t, p in _CONV_OR_IP.items()},
    "weight_filler": {t: f"{p}.weight_filler" for t, p in _CONV_OR_IP.items()},
    "bias_filler": {t: f"{p}.bias_filler" for t, p in _CONV_OR_IP.items()},
    "pad": {"conv": "convolution_param.pad", "pool": "pooling_param.pad"},
    "kernelsize": {"conv": "convolution_param.kernel_size", "pool": "pooling_param.kernel_size"},
    "group": {"conv": "convolution_param.group"},
    "stride": {"conv": "convolution_param.stride", "pool": "pooling_param.stride"},
    "pool": {"pool": "pooling_param.pool"},
    "dropout_ratio": {"dropout": "dropout_param.dropout_ratio"},
    "local_size": {"lrn": "lrn_param.local_size"},
    "alpha": {"lrn": "lrn_param.alpha"},
    "beta": {"lrn": "lrn_param.beta"},
    "k": {"lrn": "lrn_param.k"},
    "source": {"data": "data_param.source", "hdf5_data": "hdf5_data_param.source",
               "images": "image_data_param.source", "window_data": "window_data_param.source",
               "infogain_loss": "infogain_loss_param.source"},
    "scale": {_ANY: "transform_param.scale"},
    "meanfile": {_ANY: "transform_param.mean_file"},
    "cropsize": {_ANY: "transform_param.crop_size"},
    "mirror": {_ANY: "transform_param.mirror"},
    "batchsize": {"data": "data_param.batch_size", "hdf5_data": "hdf5_data_param.batch_size",
                  "images": "image_data_param.batch_size", "window_data": "window_data_param.batch_size"},
    "rand_skip": {"data": "data_param.rand_skip", "images": "image_data_param.rand_skip"},
    "shuffle_images": {"images": "image_data_param.shuffle"},
    "new_height": {"images": "image_data_param.new_height"},
    "new_width": {"images": "image_data_param.new_width"},
    "concat_dim": {"concat": "concat_param.concat_dim"},
    "det_fg_threshold": {"window_data": "window_data_param.fg_threshold"},
    "det_bg_threshold": {"window_data": "window_data_param.bg_threshold"},
    "det_fg_fraction": {"window_data": "window_data_param.fg_fraction"},
    "det_context_pad": {"window_data": "window_data_param.context_pad"},
    "det_crop_mode": {"window_data": "window_data_param.crop_mode"},
    "hdf5_output_param": {"hdf5_output": "hdf5_output_param"},
    # Weights and their learning-rate multipliers keep their V1 names.
    "blobs": {_ANY: "blobs"},
    "blobs_lr": {_ANY: "blobs_lr"},
    "weight_decay": {_ANY: "weight_decay"},
}

# V1's per-blob lists, each becoming one field of the current ParamSpec (blob i -> param[i]).
V1_PARAM_SPEC_FIELDS: dict[str, str] = {
    "param": "name",
    "blob_share_mode": "share_mode",  # same enum numbering (STRICT, PERMISSIVE)
    "blobs_lr": "lr_mult",
    "weight_decay": "decay_mult",
}

# Data layers' own transformation fields, which now live in transform_param.
DATA_PARAMS = ("data_param", "image_data_param", "window_data_param")
OLD_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

SOLVER_TYPE_NAMES: dict[str, str] = {
    "SGD": "SGD",
    "NESTEROV": "Nesterov",
    "ADAGRAD": "AdaGrad",
    "RMSPROP": "RMSProp",
    "ADADELTA": "AdaDelta",
    "ADAM": "Adam",
}


# ---- nets -------------------------------------------------------------------------------------

def net_needs_upgrade(net: pb.NetParameter) -> bool:
    return bool(len(net.layers) or len(net.input) or len(net.input_dim) or len(net.input_shape)
                or any(_old_transform_fields(layer) or layer.pooling_param.HasField("ceil_mode")
                       for layer in net.layer))


def upgrade_net(net: pb.NetParameter, path: str = "<net>", notes: list[str] | None = None) -> pb.NetParameter:
    """`net` in the current format: V0/V1 layers converted, inputs made an Input layer, old fields moved.

    Returns `net` itself when it is already current, else an upgraded copy. Appends one line per kind
    of change to `notes` when given.
    """
    if not net_needs_upgrade(net):
        return net
    notes = [] if notes is None else notes
    if len(net.layer) and len(net.layers):
        raise UserError(f"{path}: the net mixes current 'layer {{ }}' entries with old V1 'layers {{ }}' entries; "
                        "write every layer in one format")
    out = pb.NetParameter()
    out.CopyFrom(net)
    _upgrade_v0_layers(out, path, notes)
    _upgrade_v1_layers(out, path, notes)
    _move_transform_fields(out, path, notes)
    _ceil_mode_to_round_mode(out, path, notes)
    _inputs_to_layer(out, path, notes)
    return out


def _where(path: str, layer_name: str) -> str:
    """`file:line: layer 'name'` for messages; the line only when `path` is a readable text file."""
    try:
        line = layer_line(path, layer_name) if layer_name else None
    except ValueError:  # a binary .caffemodel is not UTF-8 text
        line = None
    at = f"{path}:{line}" if line else path
    return f"{at}: layer {layer_name!r}" if layer_name else f"{at}: unnamed layer"


def _assign(msg: Any, field_name: str, value: Any) -> None:
    """Set `msg.field_name = value` whatever its kind: scalar, message, or repeated (appended/extended)."""
    target = getattr(msg, field_name)
    # Repeated containers are the only field values with `extend` (FieldDescriptor.label is gone in protobuf 7).
    if hasattr(target, "extend"):
        if isinstance(value, (str, bytes, int, float)):
            target.append(value)
        else:
            target.extend(value)
    elif isinstance(target, message.Message):
        target.CopyFrom(value)
    else:
        setattr(msg, field_name, value)


def _assign_path(msg: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for name in parents:
        msg = getattr(msg, name)
    _assign(msg, last, value)


# V0 -> V1

def _upgrade_v0_layers(net: pb.NetParameter, path: str, notes: list[str]) -> None:
    n_v0 = sum(layer.HasField("layer") for layer in net.layers)
    if not n_v0:
        return
    if n_v0 != len(net.layers):
        raise UserError(f"{path}: the net mixes V0 'layers {{ layer {{ }} }}' entries with V1 ones; "
                        "write every layer in one format")
    entries, n_padding = _fold_padding_layers(list(net.layers), path)
    upgraded = [_v0_to_v1(e, path) for e in entries]
    del net.layers[:]
    net.layers.extend(upgraded)
    folded = f" (folded {n_padding} padding layer(s) into the following convolution)" if n_padding else ""
    notes.append(f"upgraded {len(upgraded)} V0 layers to V1{folded}")


def _fold_padding_layers(entries: list[pb.V1LayerParameter], path: str) -> tuple[list[pb.V1LayerParameter], int]:
    """V0 had a separate "padding" layer; its `pad` becomes the pad of the conv that reads its top."""
    padding_by_top: dict[str, pb.V1LayerParameter] = {}
    kept = []
    for entry in entries:
        if entry.layer.type == "padding":
            if len(entry.bottom) != 1 or len(entry.top) != 1:
                raise UserError(f"{_where(path, entry.layer.name)}: a V0 padding layer needs exactly one bottom "
                                f"and one top, got {len(entry.bottom)} and {len(entry.top)}")
            padding_by_top[entry.top[0]] = entry
            continue
        rewired = V1()
        rewired.CopyFrom(entry)
        for j, blob in enumerate(entry.bottom):
            pad_layer = padding_by_top.get(blob)
            if pad_layer is None:
                continue
            if entry.layer.type != "conv":
                raise UserError(f"{_where(path, entry.layer.name)}: reads {blob!r} from V0 padding layer "
                                f"{pad_layer.layer.name!r}, but only a conv layer can absorb padding "
                                f"(this one is {entry.layer.type!r})")
            rewired.bottom[j] = pad_layer.bottom[0]
            rewired.layer.pad = pad_layer.layer.pad
        kept.append(rewired)
    return kept, len(entries) - len(kept)


def _v0_to_v1(entry: pb.V1LayerParameter, path: str) -> pb.V1LayerParameter:
    v0 = entry.layer
    where = _where(path, v0.name)
    if v0.type not in V0_TYPE_NAMES:
        raise UserError(f"{where}: unknown V0 layer type {v0.type!r}; V0 types are: {', '.join(sorted(V0_TYPE_NAMES))}")
    out = V1(name=v0.name, type=V1.LayerType.Value(V0_TYPE_NAMES[v0.type]))
    out.bottom.extend(entry.bottom)
    out.top.extend(entry.top)
    for field, value in v0.ListFields():
        if field.name in ("name", "type"):
            continue
        targets = V0_FIELDS.get(field.name, {})
        target = targets.get(v0.type) or targets.get(_ANY)
        if target is None:
            users = ", ".join(sorted(targets)) or "no type"
            raise UserError(f"{where}: V0 field {field.name!r} has no meaning for a {v0.type!r} layer "
                            f"(it is used by: {users})")
        _assign_path(out, target, value)
    return out


# V1 -> current

def _upgrade_v1_layers(net: pb.NetParameter, path: str, notes: list[str]) -> None:
    if not len(net.layers):
        return
    upgraded = [_v1_to_current(v1, path) for v1 in net.layers]
    del net.layers[:]
    net.layer.extend(upgraded)
    notes.append(f"upgraded {len(upgraded)} V1 layers to the current format")


def _v1_to_current(v1: pb.V1LayerParameter, path: str) -> pb.LayerParameter:
    if not v1.HasField("type"):
        raise UserError(f"{_where(path, v1.name)}: V1 layer has no type")
    layer = pb.LayerParameter()
    for field, value in v1.ListFields():
        name = field.name
        if name == "type":
            layer.type = _v1_type(v1, path)
        elif name in V1_PARAM_SPEC_FIELDS:
            continue  # gathered into ParamSpecs below
        elif name == "layer":  # _upgrade_v0_layers has converted every V0 entry before this runs
            raise UserError(f"{_where(path, v1.name)}: V1 layer also holds a V0 'layer {{ }}' block")
        else:
            # Everything else (name, bottom, top, include, exclude, loss_weight, blobs, *_param)
            # has a field of the same name and type in LayerParameter.
            _assign(layer, name, value)
    n_blobs = max(len(getattr(v1, f)) for f in V1_PARAM_SPEC_FIELDS)
    for i in range(n_blobs):
        spec = layer.param.add()
        for v1_field, spec_field in V1_PARAM_SPEC_FIELDS.items():
            values = getattr(v1, v1_field)
            if i < len(values):
                setattr(spec, spec_field, values[i])
    return layer


def _v1_type(v1: pb.V1LayerParameter, path: str) -> str:
    enum_name = V1.LayerType.Name(v1.type)
    if enum_name not in V1_TYPE_NAMES:  # NONE
        raise UserError(f"{_where(path, v1.name)}: V1 layer type {enum_name} is not a layer type")
    return V1_TYPE_NAMES[enum_name]


# Data-transformation fields

def _old_transform_fields(layer: pb.LayerParameter) -> list[tuple[str, str]]:
    return [(p, f) for p in DATA_PARAMS if layer.HasField(p)
            for f in OLD_TRANSFORM_FIELDS if getattr(layer, p).HasField(f)]


def _move_transform_fields(net: pb.NetParameter, path: str, notes: list[str]) -> None:
    """scale/mean_file/crop_size/mirror in data_param & co. -> transform_param, where data layers read them."""
    moved_fields: list[str] = []
    n_layers = 0
    for layer in net.layer:
        old = _old_transform_fields(layer)
        if not old:
            continue
        n_layers += 1
        for param_name, field in old:
            source = getattr(layer, param_name)
            value = getattr(source, field)
            transform = layer.transform_param
            if transform.HasField(field) and getattr(transform, field) != value:
                raise UserError(f"{_where(path, layer.name)}: {param_name}.{field} is {value!r} but "
                                f"transform_param.{field} is {getattr(transform, field)!r}; keep only "
                                "transform_param's")
            setattr(transform, field, value)
            source.ClearField(field)
            if field not in moved_fields:
                moved_fields.append(field)
    if n_layers:
        notes.append(f"moved {', '.join(moved_fields)} from the data layer's own params to transform_param "
                     f"in {n_layers} layer(s)")


# Pooling rounding written the way Caffe forks do

def _ceil_mode_to_round_mode(net: pb.NetParameter, path: str, notes: list[str]) -> None:
    """`ceil_mode: false` (forks, PyTorch converters) means floor rounding: BVLC's `round_mode: FLOOR`."""
    changed = []
    for layer in net.layer:
        pool = layer.pooling_param
        if not pool.HasField("ceil_mode"):
            continue
        mode = pb.PoolingParameter.CEIL if pool.ceil_mode else pb.PoolingParameter.FLOOR
        if pool.HasField("round_mode") and pool.round_mode != mode:
            raise UserError(f"{_where(path, layer.name)}: ceil_mode: {str(pool.ceil_mode).lower()} contradicts "
                            f"round_mode: {pb.PoolingParameter.RoundMode.Name(pool.round_mode)}; keep round_mode")
        pool.round_mode = mode
        pool.ClearField("ceil_mode")
        changed.append(f"{layer.name} ({pb.PoolingParameter.RoundMode.Name(mode)})")
    if changed:
        notes.append(f"replaced the fork-only pooling ceil_mode with round_mode in {len(changed)} layer(s): "
                     f"{', '.join(changed)}")


# Net-level inputs

def _inputs_to_layer(net: pb.NetParameter, path: str, notes: list[str]) -> None:
    """`input:` + `input_shape:` or 4 `input_dim:` per input -> one Input layer at the front of the net."""
    names, shapes, dims = list(net.input), list(net.input_shape), list(net.input_dim)
    if not (names or shapes or dims):
        return
    if shapes and dims:
        raise UserError(f"{path}: the net gives both input_shape and input_dim; keep one of them")
    if not shapes and not dims:
        # A weights file (.caffemodel) may name its inputs without shapes: the deploy prototxt has them.
        net.ClearField("input")
        notes.append(f"dropped net-level input names without shapes ({', '.join(names)})")
        return
    if shapes and len(shapes) != len(names):
        raise UserError(f"{path}: {len(names)} input name(s) but {len(shapes)} input_shape entries; "
                        "give one input_shape per input")
    if dims and not names:
        raise UserError(f"{path}: {len(dims)} input_dim value(s) but no input names; give an `input:` name for each "
                        "4 input_dim values (N, C, H, W)")
    if dims and len(dims) != 4 * len(names):
        raise UserError(f"{path}: {len(names)} input name(s) need {4 * len(names)} input_dim values "
                        f"(N, C, H, W for each), got {len(dims)}")
    layer = pb.LayerParameter(name=_unused_layer_name(net, "input"), type="Input")
    layer.top.extend(names)
    for i in range(len(names)):
        shape = layer.input_param.shape.add()
        if shapes:
            shape.CopyFrom(shapes[i])
        else:
            shape.dim.extend(dims[4 * i: 4 * i + 4])
    layers = [layer] + list(net.layer)
    del net.layer[:]
    net.layer.extend(layers)
    for field in ("input", "input_shape", "input_dim"):
        net.ClearField(field)
    given = "input_shape" if shapes else "input_dim"
    described = ", ".join(f"{n} ({' '.join(str(d) for d in s.dim)})" for n, s in zip(names, layer.input_param.shape))
    notes.append(f"moved input/{given} to an Input layer {layer.name!r}: {described}")


def _unused_layer_name(net: pb.NetParameter, base: str) -> str:
    taken = {layer.name for layer in net.layer}
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


# ---- solvers ----------------------------------------------------------------------------------

def upgrade_solver(solver: pb.SolverParameter, path: str = "<solver>",
                   notes: list[str] | None = None) -> pb.SolverParameter:
    """`solver` with the old `solver_type` enum turned into the `type` string and inline nets upgraded.

    Returns `solver` itself when nothing changes, else an upgraded copy.
    """
    notes = [] if notes is None else notes
    inline_nets = _inline_nets(solver)
    if not solver.HasField("solver_type") and not any(net_needs_upgrade(net) for _, net in inline_nets):
        return solver
    out = pb.SolverParameter()
    out.CopyFrom(solver)
    if out.HasField("solver_type"):
        old = pb.SolverParameter.SolverType.Name(out.solver_type)
        new = SOLVER_TYPE_NAMES[old]
        if out.HasField("type") and out.type != new:
            raise UserError(f"{path}: solver_type: {old} and type: {out.type!r} disagree; "
                            f"remove the old solver_type")
        out.type = new
        out.ClearField("solver_type")
        notes.append(f"solver_type: {old} -> type: {new!r}")
    for label, net in _inline_nets(out):
        net_notes: list[str] = []
        upgraded = upgrade_net(net, f"{path} ({label})", net_notes)
        if upgraded is not net:
            net.CopyFrom(upgraded)
        notes.extend(f"{label}: {n}" for n in net_notes)
    return out


def _inline_nets(solver: pb.SolverParameter) -> list[tuple[str, pb.NetParameter]]:
    nets = [(f, getattr(solver, f)) for f in ("net_param", "train_net_param") if solver.HasField(f)]
    nets += [(f"test_net_param[{i}]", n) for i, n in enumerate(solver.test_net_param)]
    return nets
