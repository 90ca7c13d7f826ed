#!/usr/bin/env bash
# On the GPU machine, one call: every gpu-marked test (GPU ops against the CPU backend, the zoo layers, the
# memory runtime's acceptance with its table), LeNet trained on the GPU with the full default solver, and
# ResNet-50's speed beside PyTorch. Logs go to $OUT.
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

echo "== gpu tests"
timeout 420 python3 -m pytest -q -s -m gpu -rfE -p no:cacheprovider tests > "$OUT/gpu_test.log" 2>&1
grep -E "^(FAILED|ERROR)|^E  .*(Error|assert)" "$OUT/gpu_test.log" | head -30
tail -1 "$OUT/gpu_test.log"
echo "== memory runtime on the GPU (issue 4)"
grep "^REPORT|" "$OUT/gpu_test.log" | awk -F'|' '{printf "%-44s %16s  %s\n", $2, $3, substr($4, 1, 110)}'

echo "== LeNet, full default solver, --gpu 0"
python3 tools/make_digits_lmdb.py --out data/digits > "$OUT/data.log" 2>&1 || { tail "$OUT/data.log"; exit 1; }
/usr/bin/time -f "lenet gpu wall %e s" python3 -m superneurons train --solver models/lenet/lenet_solver.prototxt \
    --gpu 0 --log "$OUT/lenet_gpu.log" 2>&1 | grep -E "Test net output #0|Optimization|wall|rror" | tail -4

echo "== ResNet-50 batch 64 speed, ours vs PyTorch (same process)"
timeout 300 python3 tools/bench/speed.py --iterations 20 --out "$OUT" > "$OUT/speed.log" 2>&1
tail -15 "$OUT/speed.log"
