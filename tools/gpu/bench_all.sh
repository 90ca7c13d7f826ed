#!/usr/bin/env bash
# On the GPU machine: the paper's evaluation, SuperNeurons beside PyTorch in the same run.
# Each stage is one tools/bench script (each under 10 minutes on an H100/H200); logs and JSON go to $OUT,
# then tools/bench/report.py turns the JSON into $OUT/BENCHMARKS_tables.md.
#   BENCH_STAGES   stages to run, in order (default: "wider speed deeper pool cache workspace trace")
#   BENCH_QUICK=1  each stage with --quick (default stages then: "wider speed cache"): ~3-4 minutes in all
#   BENCH_ARGS     extra flags for every script (e.g. "--iterations 5")
#   BENCH_DEEPER_START=N  verify this N instead of the planner's search (deeper.py --predict-only finds it,
#                  on any machine, given the GPU machine's --host-limit; the search takes minutes at N ~ 3000)
# Stage "kernels" (not in the defaults): tools/bench/bn_kernels.py and conv_algos.py, the per-kernel views.
# Run from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
#   BENCH_QUICK=1 bash tools/gpu/bench_all.sh
set -u
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1
QUICK=${BENCH_QUICK:-0}
if [ "$QUICK" = 1 ]; then
  STAGES=${BENCH_STAGES:-"wider speed cache"}; Q="--quick"
else
  STAGES=${BENCH_STAGES:-"wider speed deeper pool cache workspace trace"}; Q=""
fi
EXTRA=${BENCH_ARGS:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

stage() {  # stage NAME MODULE [ARGS...]: one tools.bench module under a 10-minute wall clock, its output logged
  local name=$1 module=$2; shift 2
  local t0=$SECONDS flags="$Q $EXTRA"
  [ "${PLAIN:-0}" = 1 ] && flags=""  # scripts outside common.base_parser take neither --quick nor BENCH_ARGS
  # shellcheck disable=SC2086
  timeout 600 python3 -m "tools.bench.$module" $flags --out "$OUT" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  sed -n '/^$/,$p' "$OUT/$name.log" | tail -25
}

for s in $STAGES; do
  case $s in
    speed)  # split so each part stays under 10 minutes
      if [ "$QUICK" = 1 ]; then stage speed speed_zoo; else
        stage speed_resnets speed_zoo --nets resnet50,resnet101,resnet152 --tag resnets --part2
        stage speed_others speed_zoo --nets alexnet,vgg16,inception_v4,densenet121,mobilenet,squeezenet \
          --tag others; fi ;;
    wider)
      if [ "$QUICK" = 1 ]; then stage wider wider; else
        stage wider_resnets wider --nets resnet50,resnet101,resnet152 --tag resnets
        stage wider_others wider --nets alexnet,vgg16,inception_v4 --tag others; fi ;;
    deeper) stage deeper deeper ${BENCH_DEEPER_START:+--start $BENCH_DEEPER_START} ;;
    kernels) PLAIN=1 stage bn_kernels bn_kernels; PLAIN=1 stage conv_algos conv_algos ;;
    pool) stage pool pool ;;
    cache) stage cache cache ;;
    workspace) stage workspace workspace ;;
    trace) stage trace memory_trace ;;
    *) echo "unknown stage $s (speed wider deeper pool cache workspace trace kernels)" ;;
  esac
done
python3 -m tools.bench.report --in "$OUT" --out "$OUT/BENCHMARKS_tables.md" && echo "tables: $OUT/BENCHMARKS_tables.md"
