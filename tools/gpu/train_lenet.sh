#!/usr/bin/env bash
# On the GPU machine: the digits LMDB, then LeNet with `superneurons train --gpu 0` (300 iterations) and the
# same on the CPU for 100 iterations, to compare the loss curves and the speed. Logs go to $OUT.
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 tools/data/make_digits_lmdb.py --out data/digits > "$OUT/data.log" 2>&1 || { tail "$OUT/data.log"; exit 1; }
sed -e 's/^max_iter:.*/max_iter: 300/' -e 's/^snapshot:.*/snapshot: 0/' -e 's/^display:.*/display: 50/' \
    -e 's/^test_interval:.*/test_interval: 150/' models/lenet/lenet_solver.prototxt > /tmp/lenet_gpu.prototxt
sed -e 's/^max_iter:.*/max_iter: 100/' -e 's/^test_interval:.*/test_interval: 100/' /tmp/lenet_gpu.prototxt > /tmp/lenet_cpu.prototxt
/usr/bin/time -f "gpu wall %e s" python3 -m superneurons train --solver /tmp/lenet_gpu.prototxt --gpu 0 2>&1 | grep -v Warn | tail -25 | tee "$OUT/train_gpu.log"
/usr/bin/time -f "cpu wall %e s" python3 -m superneurons train --solver /tmp/lenet_cpu.prototxt 2>&1 | grep -v Warn | tail -12 | tee "$OUT/train_cpu.log"
