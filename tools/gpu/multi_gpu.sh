#!/usr/bin/env bash
# On a machine with several GPUs, one call: the data-parallel GPU tests (N ranks against one in every memory
# mode, a killed rank, a resumed N-GPU run, the one-rank NCCL checks), then the scaling benchmark beside
# PyTorch DDP. Arguments go to tools.bench.scaling (default: both nets, 1..all GPUs). Logs go to $OUT.
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
n=$(nvidia-smi -L | wc -l)
echo "== data-parallel GPU tests on $n GPUs"
timeout ${GPU_TEST_TIMEOUT:-360} python -m pytest -q -s -m gpu -rfEs --durations=12 -p no:cacheprovider tests/test_parallel_gpu.py \
    > "$OUT/parallel_gpu_test.log" 2>&1
grep -E "GPUs in|vs plain|killed rank|^(FAILED|ERROR|SKIPPED)|^E  .*(Error|assert)|s (call|setup) " "$OUT/parallel_gpu_test.log" | head -40
tail -1 "$OUT/parallel_gpu_test.log"
[ "${SCALING:-1}" = 0 ] && exit 0
echo "== scaling beside DDP"
gpus=$(seq -s, 1 "$n")
timeout ${SCALING_TIMEOUT:-420} python -m tools.bench.scaling --gpus "$gpus" --out "$OUT" "$@" 2>&1 | tee "$OUT/scaling.log" | tail -30
