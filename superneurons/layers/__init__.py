"""Every layer module in this package registers its classes on import (see `base.register`)."""
import importlib as _importlib
import pkgutil as _pkgutil

for _info in _pkgutil.iter_modules(__path__):
    if _info.name not in ("base", "fillers"):
        _importlib.import_module(f"{__name__}.{_info.name}")


def __getattr__(name: str):
    """`caffe.layers.Convolution(...)` (pycaffe's NetSpec `L`): a CamelCase name is a layer for a NetSpec."""
    if not name[:1].isupper():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from superneurons.io.net_spec import layers

    return getattr(layers, name)
