"""Caffe's device report (`superneurons device_query`): each GPU's name, capability, memory, multiprocessors
and clock, the driver, and the cuDNN and cuBLAS the GPU backend would load."""
from __future__ import annotations

import ctypes

from superneurons.backend.cuda import libs
from superneurons.backend.cuda.probe import device_count
from superneurons.errors import UserError


def _check(result):
    err, *values = result
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise UserError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


def device_report(gpu: str = "all") -> list[str]:
    """The report's lines for GPU `gpu` (a device id, or 'all')."""
    n = device_count()
    if n == 0:
        raise UserError("no CUDA device found (no NVIDIA driver or GPU on this machine); train with the CPU")
    from cuda.bindings import driver

    lines = []
    ids = range(n) if gpu == "all" else [int(gpu)]
    for i in ids:
        if not 0 <= i < n:
            raise UserError(f"--gpu {i}: this machine has {n} device(s), 0..{n - 1}")
        dev = _check(driver.cuDeviceGet(i))
        name = _check(driver.cuDeviceGetName(128, dev)).split(b"\0")[0].decode()
        total = _check(driver.cuDeviceTotalMem(dev))
        attr = driver.CUdevice_attribute
        major = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        sms = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
        clock = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev))
        lines += [f"Device id:                     {i}",
                  f"Name:                          {name}",
                  f"Compute capability:            {major}.{minor}",
                  f"Total global memory:           {total} ({total / 2**30:.1f} GiB)",
                  f"Number of multiprocessors:     {sms}",
                  f"Clock rate:                    {clock} kHz"]
    lines.append(f"Driver version:                {_check(driver.cuDriverGetVersion())}")
    try:
        lib = libs.load("cudnn")
        lines.append(f"cuDNN version:                 {lib.cudnnGetVersion()}  ({libs.path_of(lib)})")
    except UserError as e:
        lines.append(f"cuDNN:                         not found ({e})")
    try:
        lib = libs.load("cublas")
        handle, version = ctypes.c_void_p(), ctypes.c_int()
        lib.cublasCreate_v2(ctypes.byref(handle))
        lib.cublasGetVersion_v2(handle, ctypes.byref(version))
        lib.cublasDestroy_v2(handle)
        lines.append(f"cuBLAS version:                {version.value}  ({libs.path_of(lib)})")
    except (UserError, AttributeError) as e:
        lines.append(f"cuBLAS:                        not found ({e})")
    return lines
