# Sourced by the GPU scripts: a venv over the machine's packages (torch, cuDNN, numba-cuda) with the wheels
# brought in .whl/ first on the path (numpy<2.5 for numba-cuda, lmdb, plyvel, nccl4py + cuda-core, mpi4py +
# mpich: a venv, not pip --target, so mpi4py finds MPICH's library and `mpiexec` is the venv's).
VENV=${VENV:-/tmp/sn-venv}
if [ ! -e "$VENV/.ready" ]; then
    rm -rf "$VENV"; python3 -m venv --without-pip "$VENV" || return 1
    # The machine's packages after the venv's own, so the wheels here win. addsitedir (not a plain path line,
    # not --system-site-packages, which missed them on the H100) also runs their .pth files: numba-cuda's
    # makes `numba.cuda` numba-cuda's rather than numba's own old CUDA target.
    python3 -c "import sys; print('\n'.join(f'import site; site.addsitedir({p!r})' for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
        > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine.pth"
    python3 -m pip --python "$VENV/bin/python" install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
    touch "$VENV/.ready"
fi
export PATH="$VENV/bin:$PATH" PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
