"""How large a Net's pool is when nobody says: what baseline needs, and on the GPU room for workspace."""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError
from superneurons.memory.pool import round_up

# The GPU pool's default size is the device's free memory minus this margin, which stays outside the
# pool for what is allocated elsewhere: cuDNN/cuBLAS handles and library scratch, numba's loaded
# kernels, the solver's history arena (sized below from the parameters), and test nets' own pools.
GPU_MARGIN_MIN = 1 << 30  # bytes
GPU_MARGIN_FRACTION = 1 / 16  # of the device's total memory, when that is more
GPU_WORKSPACE_ALLOWANCE = 1 << 30  # bytes a pool that fits keeps beyond baseline's need, for workspace
# ... or this many times the net's largest tensor, when more: cuDNN's tensor-core engines for a large
# convolution copy its input and output gradient to NHWC in their workspace. VGG16's conv1_2 weight
# gradient at batch 64 takes 3.2 ms with such an engine and 14 ms with the best that fits 1 GiB (H200,
# tools/bench/conv_algos.py).
GPU_WORKSPACE_TENSORS = 3


def baseline_bytes(tensors: list[Any]) -> int:
    """Pool bytes of every root tensor at once."""
    return sum(round_up(t.nbytes) for t in tensors if t.base is None)


def default_pool_bytes(name: str, tensors: list[Any], backend: Any, train: bool, borrows_params: bool) -> int:
    """On the GPU, a training net's pool is what baseline needs plus GPU_WORKSPACE_ALLOWANCE, or, when
    that does not fit, the free device memory minus a margin (GPU_MARGIN_*, plus room for two solver
    history sets), so the memory techniques and convolution workspace share what is there.
    Elsewhere, and for nets that borrow another's parameters (test nets), what baseline needs."""
    need = baseline_bytes(tensors) + 4096
    device = backend.device_memory()
    if device is None or not train or borrows_params:
        return need
    free, total = device
    params = sum(round_up(t.nbytes) for t in tensors if t.base is None and t.kind == "param")
    margin = max(GPU_MARGIN_MIN, int(total * GPU_MARGIN_FRACTION)) + 2 * params
    if free - margin <= 0:
        raise UserError(f"net {name!r}: only {free / 2**20:.0f} MiB of device memory is free, under the "
                        f"{margin / 2**20:.0f} MiB kept outside the pool; free the GPU or pass --gpu-memory SIZE")
    # A net that fits takes what baseline needs plus room for convolution workspace, not the whole
    # device: other nets in the process (a test net, a second run) need their own pools.
    largest = max((t.nbytes for t in tensors if t.base is None), default=0)
    return min(free - margin, need + max(GPU_WORKSPACE_ALLOWANCE, GPU_WORKSPACE_TENSORS * largest))
