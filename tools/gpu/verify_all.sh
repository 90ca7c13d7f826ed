#!/usr/bin/env bash
# On the GPU machine: every gpu-marked test (GPU ops against the CPU backend, the zoo layers, the memory
# runtime's acceptance with its table, data input, data parallelism through NCCL, the Python API) and LeNet
# trained on the GPU with the full default solver. Logs go to $OUT.
#
# The tests take longer than one 10-minute GPU call (an H100, 2026-11-24), so they come in two parts:
#   VERIFY_PART=1 bash tools/gpu/verify_all.sh   # all but SECOND's files, the memory table and LeNet
#   VERIFY_PART=2 bash tools/gpu/verify_all.sh   # SECOND's files (about 4 minutes)
#   VERIFY_PART=1 VERIFY_SKIP="tests/a.py" bash tools/gpu/verify_all.sh   # part 1 without those files too
#   VERIFY_PART=files VERIFY_FILES="tests/a.py tests/b.py" bash tools/gpu/verify_all.sh   # those files only
# Without VERIFY_PART, one run takes everything.
set -u
SECOND="tests/test_cuda_ops.py tests/test_conv_relu_fusion.py tests/test_concat_kernels_sim.py tests/test_pycaffe_net.py
        tests/test_pycaffe_scripts.py tests/test_random_nets.py"
case "${VERIFY_PART:-all}" in
    1) TESTS="tests $(for f in $SECOND ${VERIFY_SKIP:-}; do printf -- ' --ignore=%s' "$f"; done)" ;;
    2) TESTS="$SECOND" ;;
    all) TESTS="tests" ;;
    files) TESTS="${VERIFY_FILES:?VERIFY_PART=files needs VERIFY_FILES, the test files to run}" ;;
    *) echo "VERIFY_PART must be 1, 2, files or unset, not '$VERIFY_PART'"; exit 1 ;;
esac
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import numpy, nccl.core, mpi4py; print('numpy', numpy.__version__)" 2>&1 | tail -1

echo "== gpu tests"
# shellcheck disable=SC2086  # TESTS is a list of paths and options
timeout ${GPU_TEST_TIMEOUT:-520} python -m pytest -q -s -m gpu -rfE -p no:cacheprovider $TESTS > "$OUT/gpu_test.log" 2>&1
if [ $? -eq 124 ]; then
    echo "gpu tests stopped at the ${GPU_TEST_TIMEOUT:-520} s limit: the results below are partial (VERIFY_PART=1 and 2 split them)"
fi
grep -E "^(FAILED|ERROR)|^E  .*(Error|assert)" "$OUT/gpu_test.log" | head -30
tail -1 "$OUT/gpu_test.log"
case "${VERIFY_PART:-all}" in 2|files) exit 0 ;; esac  # the memory table and LeNet come with part 1
echo "== memory runtime on the GPU"
grep "^REPORT|" "$OUT/gpu_test.log" | awk -F'|' '{printf "%-44s %16s  %s\n", $2, $3, substr($4, 1, 110)}'

echo "== LeNet, full default solver, --gpu 0"
python tools/data/make_digits_lmdb.py --out data/digits > "$OUT/data.log" 2>&1 || { tail "$OUT/data.log"; exit 1; }
/usr/bin/time -f "lenet gpu wall %e s" python -m superneurons train --solver models/lenet/lenet_solver.prototxt \
    --gpu 0 --log "$OUT/lenet_gpu.log" 2>&1 | grep -E "Test net output #0|Optimization|wall|rror" | tail -4
