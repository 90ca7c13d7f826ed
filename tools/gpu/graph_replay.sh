#!/usr/bin/env bash
# On the GPU machine: training passes replayed as CUDA graphs (runtime/graph_replay.py) in one call. Parts, run in
# the order GRAPH_PARTS names them:
#   tests   GRAPH_TEST_FILES (default: the replay's GPU tests, bit-for-bit against eager passes) and GRAPH_TESTS (a
#           pytest argument list of other GPU tests), run with replay on, as it is by default;
#   speed   speed_zoo's throughput of ours alone on GRAPH_SPEED_NETS (default GRAPH_NETS) in each of
#           GRAPH_SPEED_PRECISIONS (default GRAPH_PRECISIONS) with SUPERNEURONS_CUDA_GRAPH=0 and =1, alternating
#           GRAPH_ROUNDS times (host-bound figures move from run to run: compare within a round; GRAPH_SETTINGS
#           picks the values), in the layout GRAPH_SPEED_LAYOUT (default: SUPERNEURONS_LAYOUT's);
#   torch   PyTorch's GRAPH_TORCH_CONFIGS alone on GRAPH_TORCH_NETS (default: the same nets);
#   versus  one speed_zoo run of both sides, ours (replay on, SUPERNEURONS_LAYOUT=$GRAPH_LAYOUT, default auto) in
#           GRAPH_PRECISIONS beside PyTorch's GRAPH_TORCH_CONFIGS, with the ratios and targets in its JSON;
#           GRAPH_REPEATS alternating runs of each side per net, rows taking the medians (a host-bound eager
#           PyTorch cell moved by half between two calls of one afternoon).
# Each part's logs and JSON are packed into $OUT/<part>.tar.gz after each of its runs (the device returns at most
# eight files), so a call cut short keeps what it finished.
# Each speed_zoo run stops starting nets after its *_LIMIT seconds and is killed 45 s after that.
#   bash tools/gpu/graph_replay.sh
#   GRAPH_PARTS="versus" GRAPH_NETS="resnet50 vgg16" GRAPH_VERSUS_LIMIT=200 bash tools/gpu/graph_replay.sh
set -u
source tools/gpu/env.sh || exit 1
LOGS=$(mktemp -d)
pack() { tar -czf "$OUT/$1.tar.gz" -C "$LOGS" "$1"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
PARTS=${GRAPH_PARTS:-tests speed}
NETS=${GRAPH_NETS:-resnet50}
PRECISIONS=${GRAPH_PRECISIONS:-fp32 bf16}
CONFIGS=${GRAPH_TORCH_CONFIGS:-fp32,fp32-cl,bf16-cl}
ROUNDS=${GRAPH_ROUNDS:-1}
RUN=(--iterations 20 --warmup 5 --no-torchvision)
for part in $PARTS; do
    case $part in
    tests)
        files=${GRAPH_TEST_FILES:-tests/test_gpu_graph_replay.py}
        mkdir -p "$LOGS/tests"
        echo "== $files ${GRAPH_TESTS:-}"
        # shellcheck disable=SC2086
        timeout "${GRAPH_TEST_TIMEOUT:-240}" python -m pytest -q -s -m gpu -rfE -p no:cacheprovider --durations=5 \
            $files ${GRAPH_TESTS:-} > "$LOGS/tests/tests.log" 2>&1
        pack tests
        grep -E "^(FAILED|ERROR)|Error|graph_replay.py" "$LOGS/tests/tests.log" | sort | uniq -c | sort -rn | head -20
        tail -n 1 "$LOGS/tests/tests.log" ;;
    speed)
        limit=${GRAPH_SPEED_LIMIT:-180}
        speed_nets=${GRAPH_SPEED_NETS:-$NETS}
        speed_precisions=${GRAPH_SPEED_PRECISIONS:-$PRECISIONS}
        layout=${GRAPH_SPEED_LAYOUT:-${SUPERNEURONS_LAYOUT:-nchw}}
        mkdir -p "$LOGS/speed"
        for round in $(seq "$ROUNDS"); do
            for replay in ${GRAPH_SETTINGS:-0 1}; do
                tag="r${round}_graph$replay"
                echo "== speed_zoo ours, SUPERNEURONS_CUDA_GRAPH=$replay, SUPERNEURONS_LAYOUT=$layout, round $round"
                SUPERNEURONS_CUDA_GRAPH=$replay SUPERNEURONS_LAYOUT=$layout timeout $((limit + 45)) \
                    python -m tools.bench.speed_zoo --nets "${speed_nets// /,}" --no-torch \
                    --precisions "${speed_precisions// /,}" "${RUN[@]}" \
                    --out "$LOGS/speed/$tag" --time-limit "$limit" > "$LOGS/speed/$tag.log" 2>&1
                pack speed
                grep -E "^[A-Z][A-Za-z0-9-]+ .*[0-9]|^target|rror|graph_replay.py" "$LOGS/speed/$tag.log" \
                    | sort | uniq | tail -16
            done
        done ;;
    torch)
        limit=${GRAPH_TORCH_LIMIT:-180}
        torch_nets=${GRAPH_TORCH_NETS:-$NETS}
        mkdir -p "$LOGS/torch"
        echo "== PyTorch, same prototxt: $CONFIGS"
        timeout $((limit + 45)) python -m tools.bench.speed_zoo --nets "${torch_nets// /,}" --no-ours \
            --torch-configs "$CONFIGS" "${RUN[@]}" --out "$LOGS/torch" --time-limit "$limit" \
            > "$LOGS/torch/torch.log" 2>&1
        pack torch
        grep -E "^[A-Z][A-Za-z0-9-]+ .*[0-9]|^target|rror" "$LOGS/torch/torch.log" | tail -15 ;;
    versus)
        limit=${GRAPH_VERSUS_LIMIT:-240}
        mkdir -p "$LOGS/versus"
        echo "== ours (SUPERNEURONS_LAYOUT=${GRAPH_LAYOUT:-auto}) beside PyTorch $CONFIGS, one run"
        SUPERNEURONS_LAYOUT=${GRAPH_LAYOUT:-auto} timeout $((limit + 45)) python -m tools.bench.speed_zoo \
            --nets "${NETS// /,}" --precisions "${PRECISIONS// /,}" --torch-configs "$CONFIGS" "${RUN[@]}" \
            --repeats "${GRAPH_REPEATS:-1}" --out "$LOGS/versus" --time-limit "$limit" > "$LOGS/versus/versus.log" 2>&1
        pack versus
        grep -E "^[A-Z][A-Za-z0-9-]+ .*[0-9]|^target|rror" "$LOGS/versus/versus.log" | tail -15 ;;
    *)
        echo "unknown part $part (tests, speed, torch, versus)"; exit 1 ;;
    esac
done
