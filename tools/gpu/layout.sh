#!/usr/bin/env bash
# On the GPU machine: channels-last (NHWC) tensors in one call. The GPU tests of tests/test_cuda_channels_last.py
# (NHWC nets against the CPU in float32 and bfloat16, training to the CPU's weights), and `superneurons time` on
# ResNet-50 and VGG16 at batch 64 with SUPERNEURONS_LAYOUT=nchw and =nhwc in each of LAYOUT_PRECISIONS (`time`:
# per-layer profile; `speed`: speed_zoo's training throughput; `torch`: PyTorch's channels_last configurations).
# Logs go to $OUT.
#   bash tools/gpu/layout.sh                              # all of it
#   LAYOUT_PARTS="time" LAYOUT_NETS="vgg16" bash tools/gpu/layout.sh
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PARTS=${LAYOUT_PARTS:-tests time}
NETS=${LAYOUT_NETS:-resnet50 vgg16}
PRECISIONS=${LAYOUT_PRECISIONS:-bf16 fp32}
LAYOUTS=${LAYOUT_LAYOUTS:-nchw nhwc}
ITERATIONS=${LAYOUT_ITERATIONS:-20}
for part in $PARTS; do
    case $part in
    tests)
        echo "== tests/test_cuda_channels_last.py"
        timeout ${LAYOUT_TEST_TIMEOUT:-150} python -m pytest -q -s -m gpu -rfE -p no:cacheprovider -x \
            tests/test_cuda_channels_last.py > "$OUT/layout_tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|^(fp32|bf16):|converted|converts|Error" "$OUT/layout_tests.log" | head -30
        tail -1 "$OUT/layout_tests.log" ;;
    time)
        for net in $NETS; do
            for precision in $PRECISIONS; do
                for layout in $LAYOUTS; do
                    log="$OUT/time_${net}_${precision}_${layout}.log"
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
                --out "/tmp/speed_$layout" --time-limit ${LAYOUT_SPEED_LIMIT:-120} > "$OUT/speed_$layout.log" 2>&1
            cp "/tmp/speed_$layout/speed_zoo.json" "$OUT/speed_$layout.json" 2>/dev/null
            grep -E "^(ResNet|VGG)|rror" "$OUT/speed_$layout.log" | tail -12
        done ;;
    torch)
        echo "== PyTorch, same prototxt: fp32 channels_last and bf16 autocast channels_last"
        timeout ${LAYOUT_TORCH_TIMEOUT:-150} python -m tools.bench.speed_zoo --nets resnet50,vgg16 --no-ours \
            --torch-configs fp32-cl,bf16-cl --no-torchvision --iterations 10 --warmup 3 --out "$OUT" \
            --time-limit 120 > "$OUT/torch.log" 2>&1
        tail -15 "$OUT/torch.log" ;;
    esac
done
