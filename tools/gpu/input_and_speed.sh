#!/usr/bin/env bash
# On the GPU machine, one call: the input pipeline beside PyTorch's DataLoader (tools/bench/input.py), then
# ResNet-50's speed beside PyTorch (tools/bench/speed.py) and the data-parallel path on one GPU
# (tools/bench/scaling.py --gpus 1). Logs and JSON go to $OUT.
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
nproc | sed 's/^/cpu cores: /'; df -h /dev/shm | tail -1
echo "== input pipeline"
timeout ${INPUT_TIMEOUT:-330} python -m tools.bench.input --out "$OUT/input" > "$OUT/input.log" 2>&1
tail -40 "$OUT/input.log"
echo "== ResNet-50 b64, ours vs PyTorch"
timeout ${SPEED_TIMEOUT:-150} python -m tools.bench.speed --iterations 20 --out "$OUT" > "$OUT/speed.log" 2>&1
tail -12 "$OUT/speed.log"
echo "== data parallel on 1 GPU beside DDP"
timeout ${SCALING_TIMEOUT:-100} python -m tools.bench.scaling --gpus 1 --nets resnet50 --budget 0 --out "$OUT/scaling" > "$OUT/scaling.log" 2>&1
tail -15 "$OUT/scaling.log"
