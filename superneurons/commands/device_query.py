"""`superneurons device_query`: Caffe's device report, plus the cuDNN and cuBLAS versions we would use."""
from __future__ import annotations

import argparse

from superneurons.errors import UserError


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("device_query", help="show the GPUs, their memory and the cuDNN/cuBLAS in use",
                       epilog="example:\n  superneurons device_query --gpu 0",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="all", help="device id or 'all' (default)")
    p.set_defaults(func=run)
    return p


def _check(result):
    err, *values = result
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise UserError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


def run(args) -> int:
    from superneurons.backend.cuda.probe import device_count

    n = device_count()
    if n == 0:
        raise UserError("no CUDA device found (no NVIDIA driver or GPU on this machine); train with the CPU")
    from cuda.bindings import driver

    ids = range(n) if args.gpu == "all" else [int(args.gpu)]
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
        print(f"Device id:                     {i}")
        print(f"Name:                          {name}")
        print(f"Compute capability:            {major}.{minor}")
        print(f"Total global memory:           {total} ({total / 2**30:.1f} GiB)")
        print(f"Number of multiprocessors:     {sms}")
        print(f"Clock rate:                    {clock} kHz")
    print(f"Driver version:                {_check(driver.cuDriverGetVersion())}")
    from superneurons.backend.cuda import libs

    for lib_name, fn in (("cudnn", "cudnnGetVersion"),):
        try:
            lib = libs.load(lib_name)
            print(f"cuDNN version:                 {getattr(lib, fn)()}  ({libs.path_of(lib)})")
        except UserError as e:
            print(f"cuDNN:                         not found ({e})")
    try:
        import ctypes

        lib = libs.load("cublas")
        handle, version = ctypes.c_void_p(), ctypes.c_int()
        lib.cublasCreate_v2(ctypes.byref(handle))
        lib.cublasGetVersion_v2(handle, ctypes.byref(version))
        lib.cublasDestroy_v2(handle)
        print(f"cuBLAS version:                {version.value}  ({libs.path_of(lib)})")
    except (UserError, AttributeError) as e:
        print(f"cuBLAS:                        not found ({e})")
    return 0
