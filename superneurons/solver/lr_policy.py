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
        self.where = where
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
        if self.name == "inv" and param.gamma < 0 and 1.0 + param.gamma * param.max_iter <= 0:
            # (1 + gamma * it) ^ -power has no real value once its base reaches 0.
            raise UserError(f"{where}: lr_policy \"inv\" with gamma {param.gamma:g} makes 1 + gamma * iter <= 0 "
                            f"before max_iter {param.max_iter}; gamma must be >= 0 or above {-1.0 / param.max_iter:g}")

    def rate(self, it: int) -> float:
        """The learning rate at iteration `it` (advances multistep's counter, as Caffe does).

        A rate that is not a finite real number (an overflow, a negative base under a fractional power,
        a resumed iteration outside the policy's range) is an error naming the policy and its fields,
        rather than a NaN, a complex number or a ZeroDivisionError.
        """
        if it < 0:
            raise UserError(f"{self.where}: iteration {it} is negative; the learning rate is defined from 0 on")
        try:
            lr = self._formula(it)
        except (OverflowError, ZeroDivisionError):
            lr = None
        if not isinstance(lr, float) or not math.isfinite(lr):
            p = self.param
            raise UserError(f"{self.where}: lr_policy \"{self.name}\" gives no finite learning rate at iteration "
                            f"{it} (base_lr {p.base_lr:g}, gamma {p.gamma:g}, power {p.power:g}, stepsize "
                            f"{p.stepsize}, max_iter {p.max_iter})")
        return lr

    def _formula(self, it: int) -> float | complex:
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
        # sigmoid: exp overflowing means the rate has decayed to 0, as Caffe's 1 / (1 + inf) gives
        z = -gamma * (it - p.stepsize)
        return base / (1.0 + math.exp(z)) if z < 700 else 0.0
