# Sourced by the GPU scripts: a venv over the machine's packages (torch, cuDNN, numba-cuda) with the wheels
# brought in .whl/ first on the path (numpy<2.5 for numba-cuda, lmdb, plyvel, nccl4py + cuda-core, mpi4py +
# mpich: a venv, not pip --target, so mpi4py finds MPICH's library and `mpiexec` is the venv's).
VENV=${VENV:-/tmp/sn-venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages --without-pip "$VENV" || return 1
    python3 -m pip --python "$VENV/bin/python" install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
fi
export PATH="$VENV/bin:$PATH" PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
