#!/usr/bin/env bash
# On the GPU machine, one call: the channels-last max pooling kernels alone on $KERNEL_NET's shapes
# (tools/bench/pool_kernels.py --layout nhwc) in float32 and bfloat16, the GPU tests in $GPU_TESTS, then
# `tools.bench.speed` per net in NHWC in each of $PRECISIONS (per-kernel profile; beside PyTorch's matching
# channels_last configuration unless SPEED_TORCH=0). Logs and JSON go to $OUT/nhwc_kernels.tar.gz (the device
# tool brings back at most 8 files).
#     GPU_TESTS="tests/test_cuda_channels_last.py" bash tools/gpu/nhwc_kernels.sh resnet50
#     PRECISIONS="bf16" SPEED_TORCH=0 bash tools/gpu/nhwc_kernels.sh resnet50 vgg16
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
KERNEL_NET=${KERNEL_NET:-resnet50}
LOGS=$(mktemp -d)
trap 'tar -czf "$OUT/nhwc_kernels.tar.gz" -C "$LOGS" .' EXIT
for dtype in float32 bfloat16; do
    echo "== max pooling kernels, $KERNEL_NET b64, NHWC $dtype"
    timeout "${KERNEL_TIMEOUT:-90}" python -m tools.bench.pool_kernels --net "$KERNEL_NET" --layout nhwc \
        --dtype "$dtype" --repeat 20 --out "$LOGS" > "$LOGS/pool_kernels_$dtype.log" 2>&1
    tail -n 8 "$LOGS/pool_kernels_$dtype.log" | cut -c1-300
done
if [ -n "${GPU_TESTS:-}" ]; then
    echo "== GPU tests: $GPU_TESTS"
    # shellcheck disable=SC2086
    timeout "${GPU_TEST_TIMEOUT:-200}" python -m pytest -q -m gpu -rfE -p no:cacheprovider $GPU_TESTS \
        > "$LOGS/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)" "$LOGS/gpu_tests.log" | head -20
    tail -1 "$LOGS/gpu_tests.log"
fi
for net in "$@"; do
    for precision in ${PRECISIONS:-fp32 bf16}; do
        torch="--no-torch"
        [ "${SPEED_TORCH:-1}" = 1 ] && torch="--torch-config $([ "$precision" = fp32 ] && echo fp32-cl || echo bf16-cl)"
        log="$LOGS/speed_${net}_${precision}_nhwc.log"
        echo "== $net b64 $precision NHWC ($torch)"
        # shellcheck disable=SC2086
        SUPERNEURONS_LAYOUT=nhwc timeout "${SPEED_TIMEOUT:-150}" python -m tools.bench.speed --net "$net" --batch 64 \
            --iterations "${ITERATIONS:-10}" --warmup 3 --torch-source prototxt --precision "$precision" $torch \
            --label "${precision}_nhwc" --out "$LOGS" > "$log" 2>&1
        grep -E "^(GPU ms|prototxt, benchmark on)|ratio|img/s" "$log" | cut -c1-300
    done
done
