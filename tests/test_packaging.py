"""pyproject.toml: a CPU install without CUDA packages, and GPU extras whose CUDA wheels share one CUDA major.

Each extra is resolved with `pip install --dry-run --report` (the registry must be reachable; without it the
resolution tests skip and say so)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OFFLINE = ("No matching distribution", "Could not find a version", "NewConnectionError", "Failed to establish",
           "Temporary failure in name resolution", "Network is unreachable", "ProxyError", "timed out")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def test_cpu_dependencies_hold_no_cuda_and_no_gpu_only_pins():
    deps = {_name(r): r for r in PROJECT["project"]["dependencies"]}
    assert not [n for n in deps if n.startswith(("cuda", "nvidia", "numba-cuda"))], deps
    assert "<" not in deps["numpy"]  # the numpy cap numba-cuda needs lives in the GPU extras
    assert re.search(r">=\s*7\.35\.1", deps["protobuf"])  # 7.35.0 fails on import against the generated code


def test_metadata_style():
    project = PROJECT["project"]
    assert isinstance(project["license"], str)  # SPDX expression: no setuptools deprecation warning
    assert (REPO / "superneurons/py.typed").exists()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["superneurons"]
    extras = project["optional-dependencies"]
    assert extras["gpu"] == ["superneurons[cu12]"]
    for extra in ("cu12", "cu13"):
        names = {_name(r) for r in extras[extra]}
        assert {"numba-cuda", "cuda-bindings"} <= names and any("cudnn" in n for n in names)
        assert any("cublas" in n for n in names) and {f"nvidia-nccl-{extra}", "nccl4py"} <= names
        assert f"numba-cuda[{extra}]" in " ".join(extras[extra])


def _resolve(target: str) -> list[tuple[str, str]]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--report", "-",
           target]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("pip could not resolve within 10 minutes (no registry reachable?)")
    if proc.returncode != 0:
        if any(s in proc.stderr for s in OFFLINE) and "ResolutionImpossible" not in proc.stderr:
            pytest.skip(f"no package registry reachable: {proc.stderr.strip().splitlines()[-1][:200]}")
        raise AssertionError(proc.stderr[-3000:])
    report = json.loads(proc.stdout)
    return [(i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in report["install"]]


def cuda_major(name: str, version: str) -> int | None:
    """The CUDA major a wheel is built for: its -cuNN suffix, or for the suffix-less CUDA 13 wheels (nvidia-*,
    cuda-bindings, cuda-toolkit) its version's major. None for packages not tied to one."""
    if m := re.search(r"-cu(\d+)$", name):
        return int(m.group(1))
    if name.startswith("nvidia-") or name in ("cuda-bindings", "cuda-toolkit"):
        return int(version.split(".")[0])
    return None


def test_cuda_major_reads_names_and_versions():
    assert cuda_major("nvidia-cudnn-cu12", "9.1.0") == 12 and cuda_major("nvidia-cublas", "13.1.0.3") == 13
    assert cuda_major("cuda-bindings", "12.9.4") == 12 and cuda_major("numba-cuda", "0.30.4") is None


@pytest.mark.slow
@pytest.mark.parametrize("extra,major", [("cu12", 12), ("cu13", 13)])
def test_each_gpu_extra_resolves_to_one_cuda_major(extra, major):
    installed = _resolve(f".[{extra}]")
    names = {n for n, _ in installed}
    assert "numba-cuda" in names and "cuda-bindings" in names
    assert any("cudnn" in n for n in names) and any("cublas" in n for n in names) and any("nccl" in n for n in names)
    assert any(n.startswith("nvidia-cuda-nvrtc") for n in names)  # numba-cuda's CUDA extra came along
    majors = {(n, v): cuda_major(n, v) for n, v in installed if cuda_major(n, v) is not None}
    assert majors and set(majors.values()) == {major}, majors
    numpy = dict(installed).get("numpy")
    assert numpy is None or tuple(int(x) for x in numpy.split(".")[:2]) < (2, 5)


@pytest.mark.slow
def test_the_cpu_install_resolves_without_cuda_wheels():
    installed = _resolve(".")
    assert not [n for n, v in installed if cuda_major(n, v) is not None or n.startswith(("cuda", "numba-cuda"))]
