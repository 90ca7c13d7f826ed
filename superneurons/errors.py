"""The one exception type for a user's mistake.

Anything raised as `UserError` is printed by the CLI as a single line and exits 1;
every other exception is a bug in SuperNeurons and keeps its traceback.
"""
from __future__ import annotations

import importlib
import re
import sys
from types import ModuleType
from typing import Callable

LONG_TOKEN = 240  # characters without a space a message quotes whole; a longer one (a mangled file's line) is cut
_LONG = re.compile(r"\S{%d,}" % (LONG_TOKEN + 1))
_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")  # a Python object's repr: "<_io.BytesIO object at 0x...>"


def reason(e: BaseException) -> str:
    """What a library's exception says, in words a user can act on: Pillow's "cannot identify image file
    <_io.BytesIO object at 0x...>" names a Python object, which tells a user nothing."""
    if type(e).__name__ == "UnidentifiedImageError":
        return "not in an image format Pillow can read (PNG, JPEG, BMP, ...)"
    return _OBJECT_REPR.sub("", str(e)) or type(e).__name__


def _cut(match: re.Match) -> str:
    token = match.group(0)
    return f"{token[:LONG_TOKEN // 2]}...[{len(token)} characters]"


class UserError(Exception):
    """A problem in the user's files or flags: bad prototxt, unknown layer type, shape mismatch, missing file."""

    def __str__(self) -> str:
        # Always one line: a message may quote what a library read from a damaged file (LevelDB's status
        # names the bytes of its CURRENT file), and newlines or control characters would break the line.
        text = Exception.__str__(self)  # the message as given, whatever built-in type a subclass adds
        if not text.isprintable():
            text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
        # ... with no Python object reprs, and short enough to read: a token of thousands of characters (a
        # mutated number) is cut.
        return _LONG.sub(_cut, _OBJECT_REPR.sub("", text))


class ShapeError(UserError):
    """Two layers disagree about a blob's shape."""


class PoolExhausted(UserError):
    """The device memory pool cannot satisfy an allocation within its budget."""


# pycaffe raises built-in exceptions where Caffe checks an argument; these are ALSO those types, so code that
# catches pycaffe's (`except ValueError`) catches ours, while the command line still prints one line.
class UserValueError(UserError, ValueError):
    """A bad value (a BlobProto without a shape, a mean of another shape than the input's)."""


class UserTypeError(UserError, TypeError):
    """An argument of the wrong type (a NetSpec bottom that is not a layer's output, a phase that is not
    caffe.TRAIN or caffe.TEST)."""


def require_module(name: str, needs: str, install: str) -> ModuleType:
    """The optional module `name` (e.g. "mpi4py.MPI"), imported; missing, a one-line error saying what
    `needs` it, why the import failed and how to `install` it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise UserError(f"{needs} ({e}); {install}") from None


def exit_status(prog: str, work: Callable[[], object]) -> int:
    """A script's exit status for running `work`: 0 when it finishes; a UserError is one line
    `prog: error: ...` on stderr and 1, as the CLI reports one."""
    try:
        work()
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0
