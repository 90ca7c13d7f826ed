#!/usr/bin/env bash
# On the GPU machine, one call: the GPU tests named in $GPU_TESTS (if any), then each net's training speed
# beside PyTorch built from the same prototxt (tools/bench/speed.py, per-layer profile included), and with
# $UNFUSED_TOO=1 each net again with SUPERNEURONS_FUSE=0 (ours only). Logs and JSON go to $OUT.
# A net may carry its batch: alexnet:256 (default 64). $SPEED_ARGS go to every run (--precision bf16,
# --torch-config bf16-cl, --no-torch), $SPEED_LABEL names its logs and JSON.
#     GPU_TESTS="tests/test_conv_relu_fusion.py" bash tools/gpu/speed_nets.sh vgg16 squeezenet alexnet:256
#     SUPERNEURONS_LAYOUT=nhwc SPEED_ARGS="--precision bf16 --torch-config bf16-cl" SPEED_LABEL=bf16_nhwc \
#         bash tools/gpu/speed_nets.sh vgg16
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ -n "${GPU_TESTS:-}" ]; then
    echo "== GPU tests: $GPU_TESTS"
    # shellcheck disable=SC2086
    timeout "${GPU_TEST_TIMEOUT:-200}" python -m pytest -q -m gpu $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1
    tail -5 "$OUT/gpu_tests.log"
fi
for spec in "$@"; do
    net=${spec%%:*}; batch=64; [ "$spec" != "$net" ] && batch=${spec#*:}
    echo "== $net, batch $batch"
    label=${SPEED_LABEL:-}; log="$OUT/speed_$net${label:+_$label}.log"
    # shellcheck disable=SC2086
    timeout "${SPEED_TIMEOUT:-150}" python -m tools.bench.speed --net "$net" --batch "$batch" --iterations "${ITERATIONS:-10}" \
        --warmup 3 --torch-source prototxt --out "$OUT" ${label:+--label "$label"} ${SPEED_ARGS:-} > "$log" 2>&1
    grep -E "^(GPU ms|prototxt, benchmark on)|ratio|img/s" "$log" | cut -c1-400
    if [ "${UNFUSED_TOO:-0}" = 1 ]; then
        SUPERNEURONS_FUSE=0 timeout "${SPEED_TIMEOUT:-150}" python -m tools.bench.speed --net "$net" \
            --batch "$batch" --iterations "${ITERATIONS:-10}" --warmup 3 --no-torch --label unfused --out "$OUT" \
            > "$OUT/speed_${net}_unfused.log" 2>&1
        grep -E "^GPU ms|img/s" "$OUT/speed_${net}_unfused.log" | cut -c1-400
    fi
done
