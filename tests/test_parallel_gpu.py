"""Data parallelism on GPUs through NCCL. One GPU: `mpiexec -n 1 superneurons train --gpu 0` (the data-parallel
path: NCCL communicator, buckets averaged on the communication stream during backward) trains to the weights of
the plain `superneurons train --gpu 0`. Two or more GPUs: `--gpu 0,1` starts a process per GPU and ends with
rank 0's snapshot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from logs import messages

from superneurons.io.caffemodel import blob_to_array
from superneurons.io.prototxt import read_binary
from superneurons.parallel import launch
from superneurons.proto import superneurons_pb2 as pb

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), NCCL_NVLS_ENABLE="0",
           SUPERNEURONS_TF32="0")

ITERATIONS = 3

NET = (Path(ROOT) / "tests" / "fixtures" / "conv_bn_net.prototxt").read_text()


def _solver(tmp_path, name: str, layer_wise: bool) -> str:
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / f"{name}.prototxt").write_text(
        f'net: "net.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "fixed"\n'
        f'display: 1\nmax_iter: {ITERATIONS}\nsnapshot: {ITERATIONS}\nsnapshot_prefix: "{name}/m"\nrandom_seed: 3\n'
        f'layer_wise_reduce: {str(layer_wise).lower()}\n')
    return f"{name}.prototxt"


def _train(tmp_path, solver: str, gpu: str, ranks: int | None, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "superneurons", "train", "--solver", solver, "--gpu", gpu, "--no-progress"]
    if ranks is not None:
        cmd = [launch.find_mpiexec(), "-n", str(ranks)] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV | env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def _blobs(path) -> dict[str, np.ndarray]:
    model = read_binary(str(path), pb.NetParameter())
    return {f"{l.name}.{k}": blob_to_array(b, l.name) for l in model.layer for k, b in enumerate(l.blobs)}


def _worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, str]:
    """The largest |a - b| of a blob over the largest |a| among its layer's blobs, and which blob.

    Per layer, not per blob: the bias of a convolution that feeds BatchNorm gets a gradient that is zero in
    exact arithmetic (BatchNorm subtracts each channel's mean, so a per-channel constant changes nothing),
    so that bias holds only rounding noise (about 1e-9 here) and two runs' noise differs by 100% of itself
    while the weights beside it differ by 1e-7."""
    assert set(a) == set(b) and a
    scale: dict[str, float] = {}
    for k, v in a.items():
        layer = k.rsplit(".", 1)[0]
        scale[layer] = max(scale.get(layer, 0.0), float(np.abs(v).max()))
    return max((float(np.abs(a[k] - b[k]).max()) / (scale[k.rsplit(".", 1)[0]] + 1e-12), k) for k in a)


@pytest.mark.parametrize("layer_wise", [True, False])
def test_one_rank_through_nccl_matches_the_plain_gpu_run(tmp_path, layer_wise):
    """One rank's all-reduce is a copy and its 1/N a multiplication by 1, so the NCCL path computes what the
    plain run does; cuDNN's weight-gradient engines may sum in no fixed order, so both comparisons sit at
    float rounding (about 1e-7 on an H100 after 3 iterations), where a gradient read before backward wrote
    it or an update that does not wait for the reduction would show as 1e-2 or more."""
    plain = _train(tmp_path, _solver(tmp_path, "plain", layer_wise), "0", None)
    again = _train(tmp_path, _solver(tmp_path, "again", layer_wise), "0", None)
    dp = _train(tmp_path, _solver(tmp_path, "dp", layer_wise), "0", 1)
    assert not [m for m in messages(plain.stderr) if m.startswith("Data parallel")]  # glog lines on stderr
    assert any(m.startswith("Data parallel: 1 rank(s)") for m in messages(dp.stderr)), dp.stderr
    model = f"m_iter_{ITERATIONS}.caffemodel"
    a, b, c = (_blobs(tmp_path / name / model) for name in ("plain", "again", "dp"))
    (noise, noisy), (worst, where) = _worst(a, b), _worst(a, c)
    print(f"largest difference after {ITERATIONS} iterations, relative to the layer's largest value: "
          f"NCCL path vs plain {worst:.3g} ({where}), plain vs plain {noise:.3g} ({noisy})")
    assert noise <= 1e-5 and worst <= 1e-5


def test_deterministic_convolutions_repeat_bit_for_bit(tmp_path):
    """With SUPERNEURONS_CUDNN_DETERMINISTIC=1 nothing sums in a varying order here: two plain runs and the
    one-rank NCCL run write the same bits."""
    runs = {"plain": None, "again": None, "dp": 1}
    for name, ranks in runs.items():
        _train(tmp_path, _solver(tmp_path, name, True), "0", ranks, SUPERNEURONS_CUDNN_DETERMINISTIC="1")
    a, b, c = (_blobs(tmp_path / name / f"m_iter_{ITERATIONS}.caffemodel") for name in runs)
    for k in a:
        assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]), (k, _worst(a, b), _worst(a, c))


def test_several_gpus_one_process_each(tmp_path):
    from superneurons.parallel.devices import gpu_count

    n = gpu_count()
    if n < 2:
        pytest.skip(f"needs 2 or more GPUs, this machine has {n}")
    r = _train(tmp_path, _solver(tmp_path, "multi", True), "all", None)
    lines = messages(r.stderr)  # glog lines on stderr
    assert lines.count("Optimization Done.") == 1
    assert any(l.startswith(f"Data parallel: {n} rank(s)") for l in lines)
    assert json.loads((tmp_path / f"multi/m_iter_{ITERATIONS}.solverstate.extra").read_text())["ranks"] == n
