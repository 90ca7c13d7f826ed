#!/usr/bin/env bash
# Run on the GPU machine: what is installed, and do numba-cuda kernels, cuDNN and cuBLAS work from here?
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 - <<'PY'
import numpy, numba, google.protobuf as pbuf
print("numpy", numpy.__version__, "numba", numba.__version__, "protobuf", pbuf.__version__)
import importlib.metadata as md
for d in ("numba-cuda", "cuda-bindings", "cuda-pathfinder", "torch", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cublas", "nvidia-cublas-cu12"):
    try: print(d, md.version(d))
    except Exception as e: print(d, "-")
from numba import cuda
import numpy as np, time
@cuda.jit
def add(x, y):
    i = cuda.grid(1)
    if i < x.size: y[i] += x[i]
a = cuda.to_device(np.ones(1 << 20, np.float32)); b = cuda.to_device(np.ones(1 << 20, np.float32))
add[1024, 1024](a, b); cuda.synchronize()
t = time.perf_counter()
for _ in range(200): add[1024, 1024](a, b)
cuda.synchronize(); print("numba launch us", (time.perf_counter() - t) / 200 * 1e6, b.copy_to_host()[:2])
PY
python3 -m superneurons device_query
