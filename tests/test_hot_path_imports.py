"""No import statement runs in the code a training step calls on the GPU: the ops, the channels-last paths, the
backend's per-step methods and the Net's step loop. An import inside a function runs Python's import machinery
each time the function runs, and on a sandboxed host (gVisor) that takes a lock through the kernel: two of them
around every step held ResNet-50's bfloat16 iteration to 2303-2428 img/s on an H200, against 2903-2915 without
(docs/BENCHMARKS.md). Setup code may import lazily; the functions it may do so in are listed here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "superneurons"

# module (relative to superneurons/) -> functions that may import: set-up, first-use and error paths only
SETUP_ONLY = {
    "backend/cuda/ops/*.py": {"__init__", "release"},  # the loss reader's stream; input_copy's buffers
    "backend/cuda/channels_last_ops.py": set(),
    "backend/cuda/layout_conversion.py": {"_buffer"},  # grows a fallback buffer, once per size
    "backend/cuda/half_math.py": {"_compile_errors", "_float32_buffer"},
    "backend/cuda/copy_room.py": {"take"},  # only for a copy past the planned room
    "backend/cuda/__init__.py": {"__init__", "_collect_ops", "ops_for", "layout_conversions", "make_transfer",
                                 "make_stream", "graph_recorder"},
    "runtime/net.py": {"__init__", "_resident_choice"},
    "runtime/graph_replay.py": set(),
}


def _importing_functions(path: Path) -> set[str]:
    """Names of the functions in `path` whose own body (not a nested function's) holds an import statement."""
    found = set()

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and owner is not None:
                found.add(owner)
            else:
                visit(child, owner)

    visit(ast.parse(path.read_text()), None)
    return found


@pytest.mark.parametrize("pattern", sorted(SETUP_ONLY))
def test_step_code_imports_nothing(pattern):
    paths = sorted(ROOT.glob(pattern))
    assert paths, f"{pattern} names no file"
    offending = {f"{p.relative_to(ROOT)}:{name}" for p in paths for name in _importing_functions(p) - SETUP_ONLY[pattern]}
    assert not offending, f"import statements in functions a step may call: {sorted(offending)}"


def test_the_check_finds_an_import_in_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef step():\n    from os import path\n    return path\n\n"
                      "def outer():\n    def inner():\n        import sys\n    return inner\n")
    assert _importing_functions(module) == {"step", "inner"}
