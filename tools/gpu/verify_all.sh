#!/usr/bin/env bash
# On the GPU machine, one call: the gpu-marked tests, the default LeNet training on the GPU (the full
# `make train` solver with --gpu 0), and the profiler on ResNet-50. Logs go to $OUT.
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
make gpu-test 2>&1 | grep -v Warn | tee "$OUT/gpu_test.log" | tail -4
python3 tools/make_digits_lmdb.py --out data/digits > "$OUT/data.log" 2>&1 || { tail "$OUT/data.log"; exit 1; }
/usr/bin/time -f "lenet gpu wall %e s" python3 -m superneurons train --solver models/lenet/lenet_solver.prototxt \
    --gpu 0 --log "$OUT/lenet_gpu.log" 2>&1 | grep -E "Test net output #0|Optimization|wall|rror" | tail -6
python3 -m superneurons time --model models/resnet50/resnet50_dummy.prototxt --gpu 0 --iterations 5 \
    > "$OUT/time_resnet50.log" 2>&1; tail -8 "$OUT/time_resnet50.log"
