"""Every layer module in this package registers its classes on import (see `base.register`)."""
import importlib as _importlib
import pkgutil as _pkgutil

for _info in _pkgutil.iter_modules(__path__):
    if _info.name not in ("base", "fillers"):
        _importlib.import_module(f"{__name__}.{_info.name}")
