"""`train --tensorboard DIR`: the log's display and test records as TensorBoard scalars (through tensorboardX).

Tags: `train/loss` (the smoothed loss Caffe displays), `train/lr`, `train/iter_per_s`, `train/<output>` for each
train net output, and `test/<output>` (`test<k>/<output>` for test net k > 0) with `test/loss` when the solver
computes the test loss. The step is the iteration.
"""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError


class TensorBoardScalars:
    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard needs tensorboardX: `pip install 'superneurons[tensorboard]'` "
                            "(or `pip install tensorboardX`)") from None
        try:
            self.writer = SummaryWriter(logdir=logdir)
        except OSError as e:
            raise UserError(f"--tensorboard {logdir}: cannot write there ({e.strerror or e})") from None

    def record(self, fields: dict[str, Any]) -> None:
        """One TrainLog record (see Solver._display and Solver.test) as scalars."""
        step = int(fields.get("iter", 0))
        if fields.get("event") == "train":
            group = "train"
            for key in ("loss", "lr", "iter_per_s"):
                if key in fields:
                    self.writer.add_scalar(f"train/{key}", float(fields[key]), step)
        else:
            net = int(fields.get("net", 0) or 0)
            group = f"test{net}" if net else "test"
            if "loss" in fields:
                self.writer.add_scalar(f"{group}/loss", float(fields["loss"]), step)
        for name, value in (fields.get("outputs") or {}).items():
            if group == "train" and name == "loss":
                continue  # train/loss is the smoothed loss; the raw output is what test/ shows
            self.writer.add_scalar(f"{group}/{name}", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
