"""Caffe-style training log: the same lines Caffe prints, to stdout, optionally a file, and a JSON-lines record.

Lines keep Caffe's wording ("Iteration 100 (25.1 iter/s, 3.98s/100 iters), loss = 0.21") so
scripts written for Caffe logs (parse_log.py, plot_training_log.py) keep working. The JSON-lines
file holds one object per display or test result for tools that would rather not parse text.
"""
from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from superneurons.errors import UserError


def num(x: float) -> str:
    """A number as C++'s ostream prints it by default (6 significant digits)."""
    return f"{float(x):.6g}"


class TrainLog:
    def __init__(self, log_path: str | None = None, json_path: str | None = None, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self._file = _open(log_path) if log_path else None
        self._json = _open(json_path) if json_path else None

    def info(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
        if self._file is not None:
            print(line, file=self._file, flush=True)

    def record(self, **fields: Any) -> None:
        """One JSON object per line (display and test results)."""
        if self._json is not None:
            self._json.write(json.dumps(fields, sort_keys=False) + "\n")
            self._json.flush()

    def close(self) -> None:
        for f in (self._file, self._json):
            if f is not None:
                f.close()
        self._file = self._json = None

    def __enter__(self) -> "TrainLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: str) -> TextIO:
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot open the log file ({e.strerror or e})") from None


def score_line(name: str, value: float, loss_weight: float) -> str:
    """`loss = 0.3 (* 1 = 0.3 loss)`; the suffix only for outputs that count as loss."""
    line = f"{name} = {num(value)}"
    if loss_weight:
        line += f" (* {num(loss_weight)} = {num(loss_weight * value)} loss)"
    return line


def output_line(kind: str, index: int, name: str, value: float, loss_weight: float) -> str:
    """`    Train net output #0: loss = 0.3 (* 1 = 0.3 loss)`."""
    return f"    {kind} net output #{index}: {score_line(name, value, loss_weight)}"
