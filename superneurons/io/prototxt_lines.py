"""Where a layer stands in a prototxt file, for error messages that name the file and line."""
from __future__ import annotations


def layer_line(path: str, layer_name: str) -> int | None:
    """The 1-based line of `name: "layer_name"` in a prototxt, for error messages; None if not found."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                stripped = line.strip()
                if stripped.startswith("name") and (f'"{layer_name}"' in stripped or f"'{layer_name}'" in stripped):
                    return i
    except OSError:
        pass
    return None
