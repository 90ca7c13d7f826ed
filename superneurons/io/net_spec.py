"""pycaffe's NetSpec: write a net's prototxt from Python.

    n = caffe.NetSpec()
    n.data, n.label = L.Data(source='train_lmdb', backend=P.Data.LMDB, batch_size=64, ntop=2,
                             transform_param=dict(scale=1. / 255))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.conv1, in_place=True)
    text = str(n.to_proto())

`L.<Type>(*bottoms, **kwargs)` makes a layer: a keyword that names a field of the type's own parameter
message (`convolution_param` for Convolution) goes there, any other (`param`, `include`, `loss_weight`,
`*_param` messages) on the LayerParameter; dicts fill messages, lists fill repeated fields. `ntop=k` gives
k tops (0: the layer itself), `in_place=True` writes the top over the bottom. Layers and tops are named
after the NetSpec attributes they are assigned to; the rest get `<Type><n>`.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from superneurons.errors import UserError, UserTypeError
from superneurons.proto import superneurons_pb2 as pb

__all__ = ["NetSpec", "Top", "Function", "layers", "params", "to_proto", "param_name_dict"]

# Layer types whose parameters live in another type's message (as in our upgrade tables and Caffe's layers).
_SHARED_PARAMS = {"Deconvolution": "convolution", "Silence": None}


def param_name_dict() -> dict[str, str]:
    """Layer type -> the prefix of its `*_param` field (ConvolutionParameter -> 'convolution')."""
    out: dict[str, str] = {}
    for field in pb.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            type_name = field.message_type.name
            if type_name.endswith("Parameter"):
                out[type_name[:-len("Parameter")]] = field.name[:-len("_param")]
    for type_name, prefix in _SHARED_PARAMS.items():
        if prefix is not None:
            out.setdefault(type_name, prefix)
    return out


_PARAM_NAMES = param_name_dict()


def assign_proto(proto: Any, name: str, value: Any) -> None:
    """proto.name = value, where dicts fill sub-messages and lists (or tuples) fill repeated fields."""
    field = getattr(proto, name)  # AttributeError when the message has no such field
    if hasattr(field, "extend") and not isinstance(value, (list, tuple)):
        value = [value]
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], dict):
            for item in value:
                sub = field.add()
                for k, v in item.items():
                    assign_proto(sub, k, v)
        else:
            field.extend(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            assign_proto(field, k, v)
    else:
        setattr(proto, name, value)


class Top:
    """One output blob of a layer function; what NetSpec attributes hold and layers take as bottoms."""

    def __init__(self, fn: "Function", n: int):
        self.fn, self.n = fn, n

    def to_proto(self) -> pb.NetParameter:
        """A NetParameter of this top and everything it depends on."""
        return to_proto(self)

    def _to_proto(self, layers: OrderedDict, names: dict, autonames: Counter) -> None:
        self.fn._to_proto(layers, names, autonames)


class Function:
    """A layer: its type, bottoms (Tops) and keyword parameters."""

    def __init__(self, type_name: str, inputs: tuple, params: dict[str, Any]):
        self.type_name = type_name
        for i, bottom in enumerate(inputs):
            if not isinstance(bottom, Top):
                # pycaffe's words, which code written for it may match
                raise UserTypeError(f"{type_name} input {i} is not a Top (type is {type(bottom)})")
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = int(self.params.pop("ntop", 1))
        self.in_place = bool(self.params.pop("in_place", False))
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _top_name(self, top: Top, names: dict, autonames: Counter) -> str:
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = f"{top.fn.type_name}{autonames[top.fn.type_name]}"
        return names[top]

    def _name(self, names: dict, autonames: Counter) -> str:
        if self not in names:
            if self.ntop > 0:
                names[self] = self._top_name(self.tops[0], names, autonames)
            else:
                autonames[self.type_name] += 1
                names[self] = f"{self.type_name}{autonames[self.type_name]}"
        return names[self]

    def _to_proto(self, layers: OrderedDict, names: dict, autonames: Counter) -> None:
        if self in layers:
            return
        bottoms = []
        for bottom in self.inputs:
            bottom._to_proto(layers, names, autonames)
            bottoms.append(layers[bottom.fn].top[bottom.n])
        layer = pb.LayerParameter(type=self.type_name)
        layer.bottom.extend(bottoms)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._top_name(top, names, autonames) for top in self.tops)
        layer.name = self._name(names, autonames)
        for key, value in self.params.items():
            self._assign(layer, key, value)
        layers[self] = layer

    def _assign(self, layer: pb.LayerParameter, key: str, value: Any) -> None:
        prefix = _PARAM_NAMES.get(self.type_name)
        if not key.endswith("param") and prefix is not None:
            own = getattr(layer, prefix + "_param")
            try:
                assign_proto(own, key, value)
                return
            except AttributeError:  # not a field of the type's message: it belongs to the LayerParameter
                pass
        try:
            assign_proto(layer, key, value)
        except AttributeError:
            where = f"{prefix}_param nor " if prefix else ""
            raise UserError(f"L.{self.type_name}({key}=...): {key!r} is a field of neither {where}"
                            "LayerParameter") from None
        except (TypeError, ValueError) as e:
            raise UserError(f"L.{self.type_name}({key}={value!r}): {e}") from None


class NetSpec:
    """Tops assigned as attributes (or items) in order; `to_proto()` writes the net."""

    def __init__(self) -> None:
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name: str, value: Any) -> None:
        self.tops[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setitem__(self, key: str, value: Any) -> None:
        self.__setattr__(key, value)

    def __getitem__(self, key: str) -> Any:
        return self.__getattr__(key)

    def __delitem__(self, key: str) -> None:
        del self.tops[key]

    def keys(self) -> list[str]:
        return list(self.tops)

    def items(self) -> list[tuple[str, Any]]:
        return list(self.tops.items())

    def to_proto(self) -> pb.NetParameter:
        names = {top: name for name, top in self.tops.items()}
        autonames: Counter = Counter()
        layers: OrderedDict = OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        net = pb.NetParameter()
        net.layer.extend(layers.values())
        return net


def to_proto(*tops: Top) -> pb.NetParameter:
    """A NetParameter of these tops and everything they depend on (names: `<Type><n>`)."""
    layers: OrderedDict = OrderedDict()
    autonames: Counter = Counter()
    for top in tops:
        top.fn._to_proto(layers, {}, autonames)
    net = pb.NetParameter()
    net.layer.extend(layers.values())
    return net


class Layers:
    """`L.Convolution(bottom, ...)`: a Top (a tuple of Tops for ntop > 1, the Function for ntop=0)."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def layer_fn(*args: Top, **kwargs: Any):
            fn = Function(name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops

        layer_fn.__name__ = name
        return layer_fn


class Parameters:
    """`P.Pooling.MAX`, `P.Data.LMDB`: the enum values of <Type>Parameter."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        message = getattr(pb, name + "Parameter", None)
        if message is None:
            raise AttributeError(f"caffe.params has no {name!r}: no {name}Parameter message")

        class Param:
            def __getattr__(self, value_name: str):
                return getattr(message, value_name)

        return Param()


layers = Layers()
params = Parameters()
