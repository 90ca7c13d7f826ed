#!/usr/bin/env bash
# On the GPU machine, one call: the whole GPU test suite (`pytest -m gpu`), under whatever SUPERNEURONS_*
# settings the caller exports (SUPERNEURONS_LAYOUT=auto: every net in the layout auto picks). The files whose
# checks depend on timing run alone: the memory ones read the device's free memory, the random nets compare the
# pool step by step with the plan (under six processes sharing an H200, copies to the host lagged and held a
# block past the plan's free: 7 of 12 nets, all passing alone), and the op tests' convolutions take the
# algorithm that measured fastest (a grouped one took WINOGRAD_NONFUSED, 2e-2 off, under the same load). The
# rest run in $SUITE_WORKERS pytest-xdist processes sharing the GPU (pytest-xdist from .whl). Logs go to
# $OUT/suite.tar.gz. On one H200 (2026-12-02) the shared part took 248 s and the alone part more than 240 s, so
# the two may need a call each (a call runs 600 s at most): SUITE_PARTS picks them ("shared alone" by default).
#     SUPERNEURONS_LAYOUT=auto bash tools/gpu/suite.sh
#     SUITE_PARTS=alone SUITE_ALONE_TIMEOUT=540 bash tools/gpu/suite.sh
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
env | grep '^SUPERNEURONS_' | tee "$OUT/settings.txt"
ALONE=${SUITE_ALONE:-tests/test_gpu_memory.py tests/test_gpu_scratch.py tests/test_random_nets.py tests/test_cuda_ops.py
                    tests/test_parallel_gpu.py tests/test_pycaffe_nccl_gpu.py}
LOGS=$(mktemp -d)
ignore=""
for f in $ALONE; do ignore="$ignore --ignore=$f"; done
for part in ${SUITE_PARTS:-shared alone}; do
    case $part in
    shared)
        echo "== the suite without: $ALONE (${SUITE_WORKERS:-4} workers)"
        # shellcheck disable=SC2086
        timeout "${SUITE_TIMEOUT:-330}" python -m pytest -q -m gpu -rfE -p no:cacheprovider -n "${SUITE_WORKERS:-4}" \
            --durations=10 $ignore tests > "$LOGS/suite_shared.log" 2>&1 ;;
    alone)
        echo "== alone: $ALONE"
        # -v: a part its time limit stops still names each test it finished
        # shellcheck disable=SC2086
        timeout "${SUITE_ALONE_TIMEOUT:-360}" python -m pytest -v -m gpu -rfE -p no:cacheprovider --durations=5 \
            $ALONE > "$LOGS/suite_alone.log" 2>&1 ;;
    *)
        echo "unknown part $part (shared, alone)"; exit 1 ;;
    esac
    grep -E "^(FAILED|ERROR)" "$LOGS/suite_$part.log" | head -30; tail -n 1 "$LOGS/suite_$part.log"
    tar -czf "$OUT/suite.tar.gz" -C "$LOGS" .
done
