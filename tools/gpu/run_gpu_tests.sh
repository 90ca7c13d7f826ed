#!/usr/bin/env bash
# On the GPU machine: bring numpy<2.5 first on the path (numba-cuda 0.30 cannot compile kernels under
# numpy 2.5), then the GPU tests, a LeNet-like training run with --gpu 0, and the benchmark if present. Logs go to $OUT (or ./gpu_logs).
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "from superneurons.backend.cuda.probe import gpu_available as g; print('gpu_available', g())" 2>&1 | tee "$OUT/probe.log"
timeout 300 python3 -m pytest -q -m gpu -rA -s tests/test_cuda_ops.py 2>&1 | tail -120 > "$OUT/gpu_tests.log"
tail -60 "$OUT/gpu_tests.log"
