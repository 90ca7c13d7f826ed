#!/usr/bin/env python3
"""Kept for old scripts: the same as `superneurons compute_image_mean ...` (see its --help)."""
from __future__ import annotations

import sys

from superneurons.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["compute_image_mean", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
