"""Reading and writing Caffe's text and binary protobuf files, with errors that name the file and line."""
from __future__ import annotations

import os
import re
import tempfile
from typing import TypeVar

from google.protobuf import message, text_format

from superneurons.errors import UserError
from superneurons.io.upgrade import upgrade_net, upgrade_solver
from superneurons.proto import superneurons_pb2 as pb

M = TypeVar("M", bound=message.Message)


def parse_text(text: str, msg: M, filename: str = "<string>") -> M:
    """Parse prototxt `text` into `msg`; a syntax error becomes `file:line:col: message`."""
    try:
        text_format.Merge(text, msg, allow_unknown_field=False)
    except text_format.ParseError as e:
        line, col = e.GetLine(), e.GetColumn()
        # ParseError's str() already starts with "line:col : "; keep only the message part.
        detail = str(e).split(" : ", 1)[-1]
        where = f"{filename}:{line}:{col}" if line else filename
        layer = _enclosing_layer(text, line, col) if line else None
        raise UserError(f"{where}: {f'layer {layer!r}: ' if layer else ''}{detail}") from None
    return msg


_TOKEN = re.compile(r""""(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|#[^\n]*|[{}]|\blayers?\s*\{|\bname\s*:""")


def _enclosing_layer(text: str, line: int, col: int) -> str | None:
    """The name of the top-level `layer { ... }` block around 1-based (`line`, `col`) of a prototxt, for a
    parse error (None outside one, or when it has no name before that point)."""
    lines = text.split("\n")
    stop = sum(len(x) + 1 for x in lines[:line - 1]) + max(0, col - 1)
    depth, name, expect_name = 0, None, False
    for m in _TOKEN.finditer(text, 0, stop):
        tok = m.group(0)
        if tok.startswith("layer") and depth == 0:
            depth, name = 1, None
        elif tok == "{":
            depth += 1
        elif tok == "}":
            depth = max(0, depth - 1)
        elif tok.startswith("name"):
            expect_name = depth == 1
            continue
        elif tok[0] in "\"'" and expect_name:
            name = tok[1:-1]
        expect_name = False
    return name if depth > 0 else None


def decode_text(data: bytes, path: str, what: str = "a prototxt file") -> str:
    """`data` as UTF-8 text; a NUL byte or an invalid UTF-8 sequence is an error naming the byte offset and line.

    Caffe's prototxt files are text; a binary file given where text belongs (a .caffemodel as --model,
    a corrupted copy) must say where it stops being text rather than fail inside a decoder.
    """
    nul = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e.start if nul < 0 else min(e.start, nul)
    else:
        if nul < 0:
            return text
        bad = nul
    line = data.count(b"\n", 0, bad) + 1
    col = bad - (data.rfind(b"\n", 0, bad) + 1) + 1
    kind = "a NUL byte" if bad == nul else f"byte 0x{data[bad]:02x}, not UTF-8 text"
    raise UserError(f"{path}:{line}:{col}: {kind} at byte offset {bad}; expected {what}")


def _read_bytes(path: str, expected: str) -> bytes:
    """The whole file, or a one-line UserError naming it (`expected` says what a folder should have been)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected {expected}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None


def read_text(path: str, msg: M) -> M:
    """Read a prototxt file into `msg`."""
    return parse_text(decode_text(_read_bytes(path, "a prototxt file"), path), msg, path)


def read_binary(path: str, msg: M) -> M:
    """Read a binary protobuf file (.caffemodel, .solverstate, .binaryproto) into `msg`."""
    data = _read_bytes(path, "a binary protobuf file")
    try:
        msg.ParseFromString(data)
    except message.DecodeError as e:
        raise UserError(f"{path}: not a valid {msg.DESCRIPTOR.name} binary protobuf ({e})") from None
    return msg


TEMP_MARK = ".tmp-"  # `.NAME.tmp-PID-XXXXXXXX`: the temporary file that becomes NAME, written by process PID


def open_temp_beside(path: str, suffix: str = "") -> tuple[int, str]:
    """A new temporary file in `path`'s folder, named after `path` and this process so that it cannot be taken
    for data and a later run can tell it was left by a dead process (`remove_stale_temps`). It gets the
    permissions a plain `open` would give (0666 less the umask), not mkstemp's 0600."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{TEMP_MARK}{os.getpid()}-", suffix=suffix,
                               dir=folder)
    umask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def remove_stale_temps(folder: str, name_prefix: str) -> list[str]:
    """Delete the temporary files in `folder` for targets whose names start with `name_prefix` that were left
    by processes no longer running (a run killed mid-write); returns their paths. Files of running
    processes are kept: another run may be writing them."""
    removed = []
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return removed
    for name in names:
        if not name.startswith("." + name_prefix) or TEMP_MARK not in name:
            continue
        pid = name.rsplit(TEMP_MARK, 1)[1].split("-", 1)[0]
        if not pid.isdigit() or process_running(int(pid)):
            continue
        path = os.path.join(folder, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def process_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` whole or not at all: a temporary file in the same folder, fsync, rename."""
    fd, tmp = open_temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_binary(path: str, msg: message.Message) -> None:
    write_atomic(path, msg.SerializeToString())


def write_text(path: str, msg: message.Message) -> None:
    write_atomic(path, text_format.MessageToString(msg).encode())


def read_net(path: str) -> pb.NetParameter:
    """Read a net prototxt, upgrading V0/V1 layers to the current format."""
    net = read_text(path, pb.NetParameter())
    return upgrade_net(net, path)


def read_solver(path: str) -> pb.SolverParameter:
    solver = read_text(path, pb.SolverParameter())
    return upgrade_solver(solver, path)
