"""Where a layer stands in a prototxt file, for error messages that name the file and line."""
from __future__ import annotations

import re


def layer_line(path: str, layer_name: str) -> int | None:
    """The 1-based line of `name: "layer_name"` in a prototxt, for error messages; None if not found."""
    # `name: "x"` on a line of its own or inside a one-line `layer { name: "x" ... }`
    named = re.compile(r"""(^|[{\s])name\s*:\s*(["'])%s\2""" % re.escape(layer_name))
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if named.search(line.strip()):
                    return i
    except OSError:
        pass
    return None
