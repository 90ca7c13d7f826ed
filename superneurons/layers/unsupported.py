"""Layer types SuperNeurons recognizes but cannot run: building one is a clear error, not "unknown type"."""
from __future__ import annotations

from superneurons.errors import UserError
from superneurons.layers.base import Layer, register


@register("Python")
class PythonLayer(Layer):
    n_bottoms = (0, None)
    n_tops = (0, None)

    def __init__(self, param, phase):
        super().__init__(param, phase)
        raise UserError(f"unsupported layer type 'Python' in layer {param.name!r} "
                        f"(SuperNeurons cannot run Python layers)")
