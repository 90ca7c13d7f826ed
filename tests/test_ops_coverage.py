"""Every op of the CPU backend has a CUDA twin with the same parameters, so every layer runs with --gpu.

The op names come from each backend module's `__all__`, read with ast (no numba or GPU needed); where the
CUDA ops import (numba-cuda installed, no GPU needed), their parameter lists are compared as well.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import superneurons.backend.cpu as cpu_package

BACKEND = Path(cpu_package.__file__).resolve().parent.parent
CPU_DIR, CUDA_DIR = BACKEND / "cpu", BACKEND / "cuda" / "ops"


def declared_ops(folder: Path) -> dict[str, str]:
    """op name -> module file, from the `__all__ = [...]` of every module in `folder`."""
    ops: dict[str, str] = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                for name in ast.literal_eval(node.value):
                    assert name not in ops, f"{name} declared in {ops[name]} and {path.name}"
                    ops[name] = path.name
    return ops


def test_every_cpu_op_has_a_cuda_twin():
    cpu, cuda = declared_ops(CPU_DIR), declared_ops(CUDA_DIR)
    assert len(cpu) > 50
    missing = sorted(f"{cpu[name]}:{name}" for name in cpu if name not in cuda)
    assert not missing, f"CPU ops without a CUDA twin: {missing}"
    extra = sorted(set(cuda) - set(cpu))
    assert not extra, f"CUDA ops without a CPU reference: {extra}"


def test_cuda_twins_take_the_same_parameters():
    pytest.importorskip("numba.cuda")
    from superneurons.backend.base import collect_ops
    from superneurons.backend.cpu import CpuBackend
    from superneurons.backend.cuda import ops as cuda_package

    cpu_ops, cuda_ops = vars(CpuBackend().ops), vars(collect_ops(cuda_package))
    differ = []
    for name, fn in sorted(cpu_ops.items()):
        want = list(inspect.signature(fn).parameters)
        got = list(inspect.signature(cuda_ops[name]).parameters)
        if got != want:
            differ.append(f"{name}: cpu {want} cuda {got}")
    assert not differ, "\n".join(differ)
