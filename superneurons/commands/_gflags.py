"""Caffe's flag spellings (gflags) for a command's options, beside the usual ones.

gflags accepts `-name=value`, `-name value`, `--name=value` and `--name value`; a switch is on with
`-name` or `-name=true` and off with `-noname` or `-name=false`. argparse matches an argument that
equals a whole option string before splitting at '=', so each switch's `=true`/`=false` spellings
are hidden option strings of their own.
"""
from __future__ import annotations

import argparse

_TRUE = ("true", "t", "yes", "y", "1")
_FALSE = ("false", "f", "no", "n", "0")


def _cases(words: tuple[str, ...]) -> list[str]:
    return sorted({v for w in words for v in (w, w.upper(), w.capitalize())})


def add_flag(p: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """An option taking a value, spelled `--name` or `-name` (with a space or '=')."""
    p.add_argument(f"--{name}", f"-{name}", dest=name, **kwargs)


def add_switch(p: argparse.ArgumentParser, name: str, help: str) -> None:
    """An on/off option: `--name`, `-name`, `-name=true|false`, `-noname` (and the `--` forms)."""
    p.add_argument(f"--{name}", f"-{name}", dest=name, action="store_true", help=help)
    dashes = ("-", "--")
    on = [f"{d}{name}={v}" for d in dashes for v in _cases(_TRUE)]
    off = [f"{d}{name}={v}" for d in dashes for v in _cases(_FALSE)] + [f"{d}no{name}" for d in dashes]
    p.add_argument(*on, dest=name, action="store_true", help=argparse.SUPPRESS)
    p.add_argument(*off, dest=name, action="store_false", help=argparse.SUPPRESS)
