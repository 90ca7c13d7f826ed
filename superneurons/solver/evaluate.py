"""Scoring a TEST-phase net over several forward passes: what the solver's test and `superneurons test` print."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass
class Score:
    """One scalar output of the net, averaged over the passes (Caffe numbers them across all output blobs)."""

    name: str
    value: float
    loss_weight: float


def output_values(net: Any) -> list[tuple[str, np.ndarray, float]]:
    """(blob name, flattened values, loss weight) for each output blob, in the net's output order."""
    weights = dict(net.graph.loss_blobs)
    return [(name, net.blob(name).ravel(), float(weights.get(name, 0.0))) for name in net.graph.outputs]


def evaluate(net: Any, passes: int, first_pass: int = 0,
             on_batch: Callable[[int, list[tuple[str, np.ndarray, float]]], None] | None = None
             ) -> tuple[list[Score], float]:
    """Run `passes` forwards (ctx.iteration = first_pass, first_pass + 1, ...); mean scores and mean loss."""
    sums: np.ndarray | None = None
    names: list[tuple[str, float]] = []
    loss = 0.0
    for i in range(passes):
        net.ctx.iteration = first_pass + i
        loss += net.forward()
        outputs = output_values(net)
        if on_batch is not None:
            on_batch(i, outputs)
        flat = np.concatenate([v.astype(np.float64) for _, v, _ in outputs]) if outputs else np.zeros(0)
        if sums is None:
            sums = flat
            names = [(name, w) for name, v, w in outputs for _ in range(v.size)]
        else:
            sums += flat
    if sums is None or passes == 0:
        return [], 0.0
    return [Score(name, float(s / passes), w) for (name, w), s in zip(names, sums)], loss / passes


def score_blobs(scores: list[Score]) -> list[tuple[str, list[float], float]]:
    """evaluate's per-element scores grouped back into (blob name, values, loss weight), in order."""
    blobs: list[tuple[str, list[float], float]] = []
    for s in scores:
        if blobs and blobs[-1][0] == s.name:
            blobs[-1][1].append(s.value)
        else:
            blobs.append((s.name, [s.value], s.loss_weight))
    return blobs
