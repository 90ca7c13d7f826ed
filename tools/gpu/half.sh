#!/usr/bin/env bash
# On the GPU machine: half-precision storage on the GPU in one call. The nets and memory modes of
# tests/test_cuda_half.py, every GPU op test in bfloat16 and in float16 storage (`--storage`, tests/gpu_harness.py),
# `superneurons time` on ResNet-50 at batch 64 in each precision; and, asked by name, ResNet-50's loss over 300
# iterations in each precision over 3 seeds (tools/bench/precision_loss.py), the LSTM beside nn.LSTM in float32 and bfloat16
# (tools/bench/recurrent.py) and the widest bfloat16 ResNet-50 under 12 GiB (tools/bench/wider.py). Logs go to $OUT.
#   bash tools/gpu/half.sh              # nets, ops, time
#   HALF_PARTS="nets loss recurrent wider" bash tools/gpu/half.sh
#   HALF_PARTS=ops HALF_OPS_STORAGE=fp16 bash tools/gpu/half.sh   # one storage type
#   HALF_PARTS=wider HALF_WIDER_NETS=resnet101,resnet152 HALF_WIDER_TIMEOUT=560 bash tools/gpu/half.sh
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
PARTS=${HALF_PARTS:-nets ops time}
for part in $PARTS; do
    case $part in
    nets)
        echo "== tests/test_cuda_half.py"
        timeout 240 python -m pytest -q -s -m gpu -rfE -p no:cacheprovider tests/test_cuda_half.py \
            > "$OUT/half_nets.log" 2>&1
        grep -E "^(FAILED|ERROR)|^(bf16|fp16):|float32 copies" "$OUT/half_nets.log" | head -20; tail -1 "$OUT/half_nets.log" ;;
    ops)
        for storage in ${HALF_OPS_STORAGE:-bf16 fp16}; do
            echo "== GPU op tests, --storage $storage"
            timeout 200 python -m pytest -q -m gpu -rfE -p no:cacheprovider --storage "$storage" \
                tests/test_cuda_ops.py tests/test_cuda_zoo_ops.py > "$OUT/half_ops_$storage.log" 2>&1
            grep -E "^(FAILED|ERROR)" "$OUT/half_ops_$storage.log" | head -40; tail -1 "$OUT/half_ops_$storage.log"
        done ;;
    time)
        for precision in fp32 bf16 fp16; do
            echo "== superneurons time ResNet-50 b64 --precision $precision"
            timeout 150 python -m superneurons time --model models/resnet50/resnet50_dummy.prototxt --gpu 0 \
                --iterations 30 --precision "$precision" > "$OUT/time_resnet50_$precision.log" 2>&1
            grep -E "Average Forward-Backward|img/s|float32 copies|rror" "$OUT/time_resnet50_$precision.log" | head -8
        done ;;
    loss)
        # 3 precisions x 3 seeds: the precisions side by side on the GPU, each one process for its seeds (at most 230 s;
        # one stopped by it keeps the seeds it finished). The first run on a machine writes the data (5.8 GB, ~30 s).
        echo "== ResNet-50 b64, 300 iterations (lr to 0) on 19200 fixed images seen once, held-out loss, fp32 / bf16 / fp16 x 3 seeds"
        timeout 330 python -m tools.bench.precision_loss --seeds 1701,1702,1703 --data /tmp/precision_loss_data ${HALF_LOSS_ARGS:-} \
            --timeout 230 > "$OUT/precision_loss.log" 2>&1
        tail -9 "$OUT/precision_loss.log" ;;
    recurrent)
        for precision in fp32 bf16; do
            echo "== LSTM T=64 N=64 D=512 H=512, $precision, beside nn.LSTM"
            timeout 120 python -m tools.bench.recurrent --precision "$precision" --timeout 100 \
                > "$OUT/recurrent_$precision.log" 2>&1
            tail -4 "$OUT/recurrent_$precision.log"
        done ;;
    wider)
        nets=${HALF_WIDER_NETS:-resnet50}
        echo "== widest $nets under 12 GiB in bf16, beside PyTorch-checkpoint's (bf16 autocast, channels_last)"
        timeout "${HALF_WIDER_TIMEOUT:-420}" python -m tools.bench.wider --precision bf16 --nets "$nets" \
            --torch-variants checkpoint --host-limit "${HALF_HOST_LIMIT:-100G}" > "$OUT/wider_bf16.log" 2>&1
        tail -6 "$OUT/wider_bf16.log" ;;
    esac
done
