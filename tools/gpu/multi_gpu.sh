#!/usr/bin/env bash
# On a machine with several GPUs, one call: the data-parallel GPU tests that use several GPUs (N ranks against
# one in every memory mode, a killed rank, a resumed N-GPU run, gradients reduced in half) on each count of TEST_GPUS (default: 2 and all;
# GPUs 0..n-1), then the scaling benchmark beside PyTorch DDP. Arguments go to tools.bench.scaling (default:
# both nets, 1, 2 and all GPUs). TEST_GPUS="" skips the tests, TEST_K picks some (pytest -k), SCALING=0 skips
# the benchmark. Logs go to $OUT.
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
n=$(nvidia-smi -L | wc -l)
for k in ${TEST_GPUS-2 $n}; do
    [ "$k" -le "$n" ] || continue
    echo "== data-parallel GPU tests on $k GPUs"
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((k - 1))) timeout ${GPU_TEST_TIMEOUT:-360} python -m pytest -q -s -m gpu -rfEs \
        --durations=12 -p no:cacheprovider tests/test_parallel_gpu.py -k "${TEST_K:-several or n_gpus or killed or snapshot or half_reduction}" \
        > "$OUT/parallel_gpu_test_${k}gpu.log" 2>&1
    grep -E "GPUs in|killed rank|^(FAILED|ERROR|SKIPPED)|^E  .*(Error|assert)" "$OUT/parallel_gpu_test_${k}gpu.log" | head -20
    tail -1 "$OUT/parallel_gpu_test_${k}gpu.log"
done
[ "${SCALING:-1}" = 0 ] && exit 0
echo "== scaling beside DDP"
counts=$(printf '%s\n' 1 2 "$n" | sort -nu | paste -sd,)
timeout ${SCALING_TIMEOUT:-420} python -m tools.bench.scaling --gpus "$counts" --out "$OUT" "$@" 2>&1 | tee "$OUT/scaling.log" | tail -30
