"""Caffe's learning-rate policies: the rate for iteration `it`, from the SolverParameter.

fixed      base_lr
step       base_lr * gamma ^ floor(it / stepsize)
exp        base_lr * gamma ^ it
inv        base_lr * (1 + gamma * it) ^ (-power)
multistep  base_lr * gamma ^ (number of stepvalues reached)
poly       base_lr * (1 - it / max_iter) ^ power
sigmoid    base_lr / (1 + exp(-gamma * (it - stepsize)))

`multistep` keeps a counter (`current_step`) that a .solverstate saves, so it is a small class.
"""
from __future__ import annotations

import math

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


class LrPolicy:
    def __init__(self, param: pb.SolverParameter, where: str = "<solver>"):
        self.param = param
        self.name = param.lr_policy or "fixed"
        self.current_step = 0
        if self.name not in POLICIES:
            raise UserError(f"{where}: unknown lr_policy {self.name!r}; known: {', '.join(POLICIES)}")
        if self.name == "step" and param.stepsize <= 0:
            raise UserError(f"{where}: lr_policy \"step\" needs stepsize > 0 (got {param.stepsize})")
        if self.name == "poly" and param.max_iter <= 0:
            raise UserError(f"{where}: lr_policy \"poly\" needs max_iter > 0 (got {param.max_iter})")
        steps = list(param.stepvalue)
        if self.name == "multistep":
            if not steps:
                raise UserError(f"{where}: lr_policy \"multistep\" needs at least one stepvalue")
            if any(b <= a for a, b in zip(steps, steps[1:])):
                raise UserError(f"{where}: stepvalue must increase, got {steps}")

    def rate(self, it: int) -> float:
        """The learning rate at iteration `it` (advances multistep's counter, as Caffe does)."""
        p = self.param
        base, gamma, power = float(p.base_lr), float(p.gamma), float(p.power)
        name = self.name
        if name == "fixed":
            return base
        if name == "step":
            self.current_step = it // p.stepsize
            return base * gamma ** self.current_step
        if name == "exp":
            return base * gamma ** it
        if name == "inv":
            return base * (1.0 + gamma * it) ** (-power)
        if name == "multistep":
            # One step per call, like Caffe: the rate is asked for once per iteration.
            if self.current_step < len(p.stepvalue) and it >= p.stepvalue[self.current_step]:
                self.current_step += 1
            return base * gamma ** self.current_step
        if name == "poly":
            return base * (1.0 - it / p.max_iter) ** power
        # sigmoid
        return base / (1.0 + math.exp(-gamma * (it - p.stepsize)))
