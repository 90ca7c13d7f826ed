"""Caffe's process-wide settings for pycaffe code: CPU or GPU, which device, the random seed.

pycaffe keeps these in a global (`Caffe::mode()`); every Net and Solver built afterwards uses them.
Here they pick the backend a new `Net`/`Solver` runs on. Backends are made once per device and shared,
as Caffe shares its cuBLAS/cuDNN handles.
"""
from __future__ import annotations

from typing import Any

_state: dict[str, Any] = {"gpu": False, "device": 0, "seed": None}
_backends: dict[tuple[str, int], Any] = {}


def set_mode_cpu() -> None:
    """Run the Nets and Solvers built from now on on the CPU (the NumPy backend)."""
    _state["gpu"] = False


def set_mode_gpu() -> None:
    """Run the Nets and Solvers built from now on on the GPU chosen with `set_device` (default 0)."""
    _state["gpu"] = True


def set_device(device_id: int) -> None:
    """The GPU that `set_mode_gpu` uses."""
    _state["device"] = int(device_id)


def set_random_seed(seed: int) -> None:
    """Seed of the weight fillers (and Dropout masks) of the Nets built from now on; solvers keep their
    prototxt's `random_seed`."""
    _state["seed"] = int(seed)


def random_seed(default: int = 0) -> int:
    seed = _state["seed"]
    return default if seed is None else seed


def current_backend() -> Any:
    """The backend for the current mode, made on first use."""
    from superneurons.backend import get_backend

    from superneurons.errors import UserError

    key = ("cuda", _state["device"]) if _state["gpu"] else ("cpu", 0)
    if key not in _backends:
        try:
            _backends[key] = get_backend(*key)
        except UserError as e:
            raise UserError(f"caffe.set_mode_gpu() (device {key[1]}): {e} "
                            "(from Python: caffe.set_mode_cpu())") from None
    return _backends[key]


def is_gpu() -> bool:
    return bool(_state["gpu"])
