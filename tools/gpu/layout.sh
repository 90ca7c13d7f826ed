#!/usr/bin/env bash
# On the GPU machine: channels-last (NHWC) tensors in one call. The GPU tests of tests/test_cuda_channels_last.py
# (NHWC nets against the CPU in float32 and bfloat16, training to the CPU's weights), and `superneurons time` on
# ResNet-50 and VGG16 at batch 64 with SUPERNEURONS_LAYOUT=nchw and =nhwc in each of LAYOUT_PRECISIONS (`time`:
# per-layer profile; `speed`: speed_zoo's training throughput; `torch`: PyTorch's configurations
# LAYOUT_TORCH_CONFIGS, default its two channels_last ones). LAYOUT_TESTS adds GPU tests of other files (a
# pytest argument list). Logs and JSON go to $OUT/layout.tar.gz (the device tool brings back at most 8 files).
#   bash tools/gpu/layout.sh                              # all of it
#   LAYOUT_PARTS="time" LAYOUT_NETS="vgg16" bash tools/gpu/layout.sh
#   LAYOUT_PARTS="tests speed torch" LAYOUT_NETS="inception_v4 squeezenet" LAYOUT_TORCH_CONFIGS=fp32,fp32-cl,bf16-cl \
#       LAYOUT_TESTS="tests/test_cuda_ops.py -k concat" bash tools/gpu/layout.sh
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PARTS=${LAYOUT_PARTS:-tests time}
NETS=${LAYOUT_NETS:-resnet50 vgg16}
PRECISIONS=${LAYOUT_PRECISIONS:-bf16 fp32}
LAYOUTS=${LAYOUT_LAYOUTS:-nchw nhwc}
ITERATIONS=${LAYOUT_ITERATIONS:-20}
LOGS=$(mktemp -d)
trap 'tar -czf "$OUT/layout.tar.gz" -C "$LOGS" .' EXIT
for part in $PARTS; do
    case $part in
    tests)
        echo "== tests/test_cuda_channels_last.py"
        timeout ${LAYOUT_TEST_TIMEOUT:-150} python -m pytest -q -s -m gpu -rfE -p no:cacheprovider -x \
            tests/test_cuda_channels_last.py > "$LOGS/layout_tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|^(fp32|bf16):|converted|converts|Error" "$LOGS/layout_tests.log" | head -30
        tail -1 "$LOGS/layout_tests.log"
        if [ -n "${LAYOUT_TESTS:-}" ]; then
            echo "== $LAYOUT_TESTS"
            # shellcheck disable=SC2086
            timeout ${LAYOUT_TEST_TIMEOUT:-150} python -m pytest -q -m gpu -rfE -p no:cacheprovider $LAYOUT_TESTS \
                > "$LOGS/other_tests.log" 2>&1
            grep -E "^(FAILED|ERROR)" "$LOGS/other_tests.log" | head -10
            tail -1 "$LOGS/other_tests.log"
        fi ;;
    time)
        for net in $NETS; do
            for precision in $PRECISIONS; do
                for layout in $LAYOUTS; do
                    log="$LOGS/time_${net}_${precision}_${layout}.log"
                    echo "== superneurons time $net b64 --precision $precision SUPERNEURONS_LAYOUT=$layout"
                    SUPERNEURONS_LAYOUT=$layout timeout ${LAYOUT_TIME_TIMEOUT:-75} python -m superneurons time \
                        --model "models/$net/${net}_dummy.prototxt" --gpu 0 --iterations "$ITERATIONS" \
                        --precision "$precision" > "$log" 2>&1
                    grep -E "Average Forward-Backward|img/s|converts|copies|rror" "$log" | grep -v "^I1\|^W1" | head -8
                done
            done
        done ;;
    speed)
        # ours, real training throughput (the solver's step), per layout
        for layout in $LAYOUTS; do
            echo "== speed_zoo ours, SUPERNEURONS_LAYOUT=$layout, --precisions ${PRECISIONS// /,}"
            SUPERNEURONS_LAYOUT=$layout timeout ${LAYOUT_SPEED_TIMEOUT:-150} python -m tools.bench.speed_zoo \
                --nets "${NETS// /,}" --no-torch --precisions "${PRECISIONS// /,}" --iterations 10 --warmup 3 \
                --out "/tmp/speed_$layout" --time-limit ${LAYOUT_SPEED_LIMIT:-120} > "$LOGS/speed_$layout.log" 2>&1
            cp "/tmp/speed_$layout/speed_zoo.json" "$LOGS/speed_$layout.json" 2>/dev/null
            grep -E "^[A-Z][A-Za-z0-9-]+ .*[0-9]|rror" "$LOGS/speed_$layout.log" | tail -16
        done ;;
    torch)
        configs=${LAYOUT_TORCH_CONFIGS:-fp32-cl,bf16-cl}
        echo "== PyTorch, same prototxt: $configs"
        timeout ${LAYOUT_TORCH_TIMEOUT:-150} python -m tools.bench.speed_zoo --nets "${NETS// /,}" --no-ours \
            --torch-configs "$configs" --no-torchvision --iterations 10 --warmup 3 --out "$LOGS" \
            --time-limit ${LAYOUT_TORCH_LIMIT:-120} > "$LOGS/torch.log" 2>&1
        tail -15 "$LOGS/torch.log" ;;
    esac
done
