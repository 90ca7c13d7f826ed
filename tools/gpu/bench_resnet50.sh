#!/usr/bin/env bash
# On the GPU machine: ResNet-50 (batch 64) training speed, SuperNeurons against PyTorch in the same run.
#   1. the per-layer profile (`superneurons time`, 5 iterations, syncs around every layer),
#   2. ours with the colleague's launch path and one-block-per-channel reductions (SUPERNEURONS_FAST_LAUNCH=0
#      SUPERNEURONS_CUDA_SPREAD=0), ours as shipped, and PyTorch (cudnn.benchmark on and off).
#   3. optional stages: "heuristics" (SUPERNEURONS_CUDNN_FIND=0: algorithms by cuDNN's heuristics) and "unfused" (SUPERNEURONS_FUSE=0), ours only;
#      "overhead" (tools/bench/conv_overhead.py: host microseconds per cuDNN convolution call, legacy vs graph API);
#      "legacy_api" (convolutions on cuDNN's legacy API, SUPERNEURONS_CUDNN_GRAPH=0), ours only.
# Logs and JSON go to $OUT (or ./gpu_logs). BENCH_STAGES picks stages (default "time legacy main").
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ITER=${BENCH_ITERATIONS:-20}
STAGES=${BENCH_STAGES:-"time legacy main"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for stage in $STAGES; do
  case $stage in
    time)
      timeout 240 python3 -m superneurons time --model models/resnet50/resnet50_dummy.prototxt --gpu 0 \
        --iterations 5 > "$OUT/time_resnet50.txt" 2>&1; echo "time rc=$?"
      sort -t' ' -k1,1 "$OUT/time_resnet50.txt" >/dev/null
      tail -7 "$OUT/time_resnet50.txt" ;;
    legacy)
      SUPERNEURONS_FAST_LAUNCH=0 SUPERNEURONS_CUDA_SPREAD=0 timeout 240 python3 -m tools.bench.speed \
        --iterations "$ITER" --label legacy --no-torch --out "$OUT" 2>&1 | tee "$OUT/bench_legacy.log" | tail -6 ;;
    heuristics)
      SUPERNEURONS_CUDNN_FIND=0 timeout 240 python3 -m tools.bench.speed --iterations "$ITER" --label heuristics \
        --no-torch --out "$OUT" 2>&1 | tee "$OUT/bench_heuristics.log" | tail -6 ;;
    unfused)
      SUPERNEURONS_FUSE=0 timeout 240 python3 -m tools.bench.speed --iterations "$ITER" --label unfused \
        --no-torch --out "$OUT" 2>&1 | tee "$OUT/bench_unfused.log" | tail -6 ;;
    overhead)
      timeout 120 python3 -m tools.bench.conv_overhead --out "$OUT" 2>&1 | tee "$OUT/conv_overhead.log" | tail -30 ;;
    legacy_api)
      SUPERNEURONS_CUDNN_GRAPH=0 timeout 240 python3 -m tools.bench.speed --iterations "$ITER" --label legacy_api \
        --no-torch --out "$OUT" 2>&1 | tee "$OUT/bench_legacy_api.log" | tail -6 ;;
    main)
      timeout 300 python3 -m tools.bench.speed --iterations "$ITER" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -8 ;;
  esac
done
