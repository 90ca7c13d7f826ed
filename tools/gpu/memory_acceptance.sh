#!/usr/bin/env bash
# The memory runtime's acceptance on the GPU machine: the memory runtime's GPU tests (tests/test_gpu_memory.py), then a
# table of what they measured. Each test prints `REPORT|name|value|detail`; failures name the numbers that differ.
#   (a) every --memory mode trains a small fan/join/BN/Dropout net to baseline's weights (and without the cache)
#   (b) ResNet-50 (batch $SN_ACCEPT_BATCH, default 8) under a budget below liveness's need: auto trains it,
#       $SN_ACCEPT_ITERS (default 20) iterations, weights within tolerance of an unconstrained run, bytes moved > 0
#   (c) the same net in a budget that fits: zero bytes moved
#   (d) the pool's per-step bytes equal the plan's (workspace excluded)
#   (e) pinned D2H copies overlap compute (reported, not asserted)
# Usage (repository root): bash tools/gpu/memory_acceptance.sh        logs go to $OUT (or ./gpu_logs)
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # numpy<2.5 first on the path (numba-cuda 0.30 needs it)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
fi
export SUPERNEURONS_TF32=0
LOG="$OUT/memory_acceptance.log"
timeout 1500 python3 -m pytest -q -s -m gpu -rA tests/test_gpu_memory.py >"$LOG" 2>&1
rc=$?
echo "== failures (if any) =="
grep -E "^(FAILED|ERROR)|AssertionError|^E  " "$LOG" | head -40
echo
echo "== memory runtime GPU acceptance =="
python3 - "$LOG" <<'PY'
import sys
rows = [line.rstrip("\n").split("|", 3)[1:] for line in open(sys.argv[1]) if line.startswith("REPORT|")]
w = max([len(r[0]) for r in rows] + [10])
print(f"{'check':<{w}}  {'value':>14}  detail")
for name, value, detail in rows:
    print(f"{name:<{w}}  {value:>14}  {detail}")
PY
tail -3 "$LOG"
exit $rc
