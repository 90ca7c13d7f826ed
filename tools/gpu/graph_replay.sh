#!/usr/bin/env bash
# On the GPU machine: training passes replayed as CUDA graphs (runtime/graph_replay.py) in one call. `tests`: the
# replay's GPU tests (bit-for-bit against eager passes) and GRAPH_TESTS (a pytest argument list of other GPU tests,
# run with replay on, as it is by default); `speed`: speed_zoo's training throughput of GRAPH_NETS in each of
# GRAPH_PRECISIONS with SUPERNEURONS_CUDA_GRAPH=0 and =1, alternating GRAPH_ROUNDS times (host-bound figures move
# from run to run: compare within a round; GRAPH_SETTINGS picks the values); `torch`: PyTorch's GRAPH_TORCH_CONFIGS
# on GRAPH_TORCH_NETS (default: the same nets).
# Logs and JSON go to $OUT/graph_replay.tar.gz.
#   bash tools/gpu/graph_replay.sh
#   GRAPH_PARTS="speed torch" GRAPH_NETS="resnet50 densenet121" GRAPH_PRECISIONS="fp32 bf16" bash tools/gpu/graph_replay.sh
set -u
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PARTS=${GRAPH_PARTS:-tests speed}
NETS=${GRAPH_NETS:-resnet50}
PRECISIONS=${GRAPH_PRECISIONS:-fp32 bf16}
ROUNDS=${GRAPH_ROUNDS:-1}
LOGS=$(mktemp -d)
trap 'tar -czf "$OUT/graph_replay.tar.gz" -C "$LOGS" .' EXIT
for part in $PARTS; do
    case $part in
    tests)
        echo "== tests/test_gpu_graph_replay.py ${GRAPH_TESTS:-}"  # (a pytest argument list)
        # shellcheck disable=SC2086
        timeout ${GRAPH_TEST_TIMEOUT:-240} python -m pytest -q -s -m gpu -rfE -p no:cacheprovider \
            tests/test_gpu_graph_replay.py ${GRAPH_TESTS:-} > "$LOGS/tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|Error|graph_replay.py" "$LOGS/tests.log" | sort | uniq -c | sort -rn | head -20
        tail -1 "$LOGS/tests.log" ;;
    speed)
        for round in $(seq "$ROUNDS"); do
            for replay in ${GRAPH_SETTINGS:-0 1}; do
                tag="r${round}_graph$replay"
                echo "== speed_zoo ours, SUPERNEURONS_CUDA_GRAPH=$replay, round $round"
                SUPERNEURONS_CUDA_GRAPH=$replay timeout ${GRAPH_SPEED_TIMEOUT:-200} python -m tools.bench.speed_zoo \
                    --nets "${NETS// /,}" --no-torch --precisions "${PRECISIONS// /,}" --iterations 20 --warmup 5 \
                    --out "/tmp/speed_$tag" --time-limit ${GRAPH_SPEED_LIMIT:-180} > "$LOGS/speed_$tag.log" 2>&1
                cp "/tmp/speed_$tag/speed_zoo.json" "$LOGS/speed_$tag.json" 2>/dev/null
                grep -E "^[A-Z][A-Za-z0-9-]+ .*[0-9]|rror|graph_replay.py" "$LOGS/speed_$tag.log" | sort | uniq | tail -16
            done
        done ;;
    torch)
        configs=${GRAPH_TORCH_CONFIGS:-fp32,fp32-cl,bf16-cl}
        echo "== PyTorch, same prototxt: $configs"
        torch_nets=${GRAPH_TORCH_NETS:-$NETS}
        timeout ${GRAPH_TORCH_TIMEOUT:-200} python -m tools.bench.speed_zoo --nets "${torch_nets// /,}" --no-ours \
            --torch-configs "$configs" --no-torchvision --iterations 20 --warmup 5 --out "$LOGS" \
            --time-limit ${GRAPH_TORCH_LIMIT:-180} > "$LOGS/torch.log" 2>&1
        tail -15 "$LOGS/torch.log" ;;
    esac
done
