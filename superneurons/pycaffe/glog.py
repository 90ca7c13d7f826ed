"""pycaffe's `init_log`, `log` and `Timer`: a line in the training log's format from a script, and a stopwatch.

`log(text)` writes `I1124 03:15:49.123456 12345 script.py:12] text` on stderr, the glog line the solver's
own lines use (runtime/logging.py), so a script's lines interleave with them in one readable log.
`init_log(level=0, stderr=True)`: lines below `level` (0 INFO, 1 WARNING, 2 ERROR) are left out.
"""
from __future__ import annotations

import sys
import time

from superneurons.runtime.logging import glog_prefix

_settings = {"level": 0}


def init_log(level: int = 0, stderr: bool = True) -> None:
    """Start logging: `log` lines of severity `level` and above go to stderr (glog's INFO is 0)."""
    _settings["level"] = int(level)


def log(text: str) -> None:
    """One INFO line in glog's format, naming the caller's file and line."""
    if _settings["level"] > 0:
        return
    frame = sys._getframe(1)
    where = (frame.f_code.co_filename.rsplit("/", 1)[-1], frame.f_lineno)
    print(glog_prefix("I", where) + str(text), file=sys.stderr, flush=True)


class Timer:
    """Caffe's Timer: `start()`, `stop()`, and `ms`, the milliseconds between them (while running: so far)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._elapsed = 0.0
        self._running = False

    def start(self) -> None:
        self._start, self._running = time.perf_counter(), True

    def stop(self) -> None:
        if self._running:
            self._elapsed = time.perf_counter() - self._start
            self._running = False

    @property
    def ms(self) -> float:
        if self._running:
            return (time.perf_counter() - self._start) * 1000.0
        return self._elapsed * 1000.0
