#!/usr/bin/env bash
# On a machine with several GPUs: one-GPU jobs side by side, job k on GPU k-1 with its logs in gpuK-1/ of
# $OUT/per_gpu_logs.tgz,
# so one call does what would take several calls on one GPU. Each argument is one job, a shell command line:
#   bash tools/gpu/per_gpu.sh "VERIFY_PART=1 bash tools/gpu/verify_all.sh" "HALF_PARTS=loss bash tools/gpu/half.sh"
# The jobs share the host's cores: a host-bound timing taken here is not a quiet machine's.
set -u
source tools/gpu/env.sh || exit 1   # once, before the jobs, so they do not build the venv at the same time
n=$(nvidia-smi -L | wc -l)
[ "$#" -le "$n" ] || { echo "per_gpu.sh: $# jobs for $n GPUs"; exit 1; }
root=$OUT; k=0; pids=()
for job in "$@"; do
    mkdir -p "$root/gpu$k"; echo "$job" > "$root/gpu$k/job.txt"
    OUT="$root/gpu$k" CUDA_VISIBLE_DEVICES=$k bash -c "$job" > "$root/gpu$k/stdout.txt" 2>&1 &
    pids+=("$!"); k=$((k + 1))
done
status=0; k=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
    echo "=== GPU $k: $(cat "$root/gpu$k/job.txt")"; cat "$root/gpu$k/stdout.txt"; k=$((k + 1))
done
# The device tool brings back a few files only: the jobs' logs come back as one archive.
tar -czf "$root/per_gpu_logs.tgz" -C "$root" $(cd "$root" && ls -d gpu*) && rm -rf "$root"/gpu*
exit $status
