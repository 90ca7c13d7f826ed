"""The live progress bar of `superneurons train`: iterations done of max_iter, iter/s, ETA, smoothed loss.

It shows only where a person watches: when the log's stream (stderr, as glog's) is a terminal and the `CI`
environment variable is unset; `--no-progress` turns it off everywhere. A log file, a pipe or a CI
job therefore gets exactly the Caffe log lines, with no carriage returns or bar characters.

While the bar is up, every log line goes through `tqdm.write`, which clears the bar, prints the
whole line above it and redraws the bar, so Caffe's lines stay intact on the terminal too. The
bar is driven by the solver's per-iteration callback (`Solver.callbacks`).
"""
from __future__ import annotations

import io
import os
import sys
from typing import Any, Mapping, TextIO

_FALSE = ("", "0", "false", "no", "off")


def progress_wanted(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """True when `stream` is a terminal and we are not in CI (a dumb terminal cannot redraw)."""
    env = os.environ if environ is None else environ
    if env.get("CI", "").strip().lower() not in _FALSE or env.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or odd stream
        return False


class TrainProgress:
    """A tqdm bar over [start iteration, total]; `enabled=None` decides with `progress_wanted`."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool | None = None,
                 environ: Mapping[str, str] | None = None, mininterval: float = 0.2):
        self.stream = stream if stream is not None else sys.stderr
        self.total = int(total)
        self.enabled = progress_wanted(self.stream, environ) if enabled is None else bool(enabled)
        self.mininterval = mininterval
        self.bar: Any = None
        self.done = False

    # -- the solver hook -------------------------------------------------------------------------
    def __call__(self, solver: Any, iteration: int, loss: float) -> None:
        """Solver.callbacks signature: (solver, iteration just completed, its loss)."""
        self.update(iteration, getattr(solver, "smoothed_loss", loss))

    def update(self, iteration: int, smoothed_loss: float) -> None:
        if not self.enabled or self.done:
            return
        try:
            if self.bar is None:  # opened at the first completed iteration, so a resumed run starts where it is
                self._open(initial=max(0, iteration - 1))
            self.bar.set_postfix(loss=f"{smoothed_loss:.4g}", refresh=False)
            self.bar.update(iteration - self.bar.n)
        except (OSError, ValueError):  # the terminal is gone (hung up, closed): training goes on without a bar
            self.bar, self.enabled = None, False
            return
        if iteration >= self.total:  # the loop is over: later lines (final test, "Optimization Done.") go below
            self.close()

    def _open(self, initial: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, initial=initial, file=self.stream, desc="Training", unit="iter",
                        leave=True, mininterval=self.mininterval, disable=False, **bar_size(self.stream))

    # -- log lines -------------------------------------------------------------------------------
    def write(self, line: str) -> None:
        """One whole log line, printed above the bar when it is up."""
        if self.bar is not None:
            from tqdm import tqdm

            tqdm.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def line_stream(self) -> "_LineStream":
        """A file-like object for TrainLog.stream: complete lines go through `write`."""
        return _LineStream(self)

    def attach(self, solver: Any, log: Any) -> "TrainProgress":
        """Hook into a solver and route its log's stream through the bar; a no-op when disabled."""
        if self.enabled:
            solver.callbacks.append(self)
            log.stream = self.line_stream()
        return self

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            try:
                bar.close()
            except (OSError, ValueError):  # a terminal that is gone
                pass
        self.done = True

    def __enter__(self) -> "TrainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar_size(stream: TextIO) -> dict[str, Any]:
    """tqdm's size arguments for a bar on `stream`: the terminal's width, followed as it changes; a terminal
    that reports no width (a pty nobody sized, as under `script`) gets 100 columns."""
    return {"dynamic_ncols": True} if _columns(stream) != 0 else {"ncols": 100, "nrows": 24}


def _columns(stream: TextIO) -> int | None:
    """The terminal's width, 0 when it reports none, None when the stream has no terminal behind it."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return None


class _LineStream:
    """What `print(line, file=...)` writes to: buffers text and hands on whole lines."""

    def __init__(self, progress: TrainProgress):
        self.progress = progress
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self.progress.write(line)
        return len(text)

    def flush(self) -> None:
        self.progress.stream.flush()

    def isatty(self) -> bool:
        isatty = getattr(self.progress.stream, "isatty", None)
        return bool(isatty and isatty())
