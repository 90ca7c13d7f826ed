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


def device() -> int:
    """The GPU `set_device` chose."""
    return int(_state["device"])


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


# Data parallelism the train.py way (one process per GPU, each told its place): Caffe's solver_count and
# solver_rank. The NCCL object of pycaffe/nccl.py reads them; `set_multiprocess` is Caffe's flag that the
# ranks are processes, not threads, which is the only way SuperNeurons runs them.
_ranks: dict[str, Any] = {"count": 1, "rank": 0, "multiprocess": False}


def solver_count() -> int:
    """How many solvers (processes) train together."""
    return int(_ranks["count"])


def set_solver_count(count: int) -> None:
    _ranks["count"] = int(count)


def solver_rank() -> int:
    """This process's place among them (0: the one that logs and snapshots)."""
    return int(_ranks["rank"])


def set_solver_rank(rank: int) -> None:
    _ranks["rank"] = int(rank)


def set_multiprocess(multiprocess: bool) -> None:
    _ranks["multiprocess"] = bool(multiprocess)
