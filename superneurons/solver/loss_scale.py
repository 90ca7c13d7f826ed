"""Loss scaling for half-precision gradients: the solver's side of the net's `global_grad_scale`.

float16 holds magnitudes from 6e-8 (subnormal) to 65504: small gradients underflow to zero. The Net seeds
the loss's gradient with weight x scale, so every gradient of the pass is `scale` times larger, and the
update divides the weight gradients by it again (before clipping and the rule).
- static (`global_grad_scale: K`): K every iteration.
- adaptive (`global_grad_scale_adaptive: true`): starts at global_grad_scale, or at 2^16 where that is left
  at 1; an iteration whose weight gradients hold Inf or NaN is skipped (no update) and the scale halved;
  GROWTH_INTERVAL clean iterations in a row double it. Each change is logged. A scale below 2^-24 (float16's
  smallest subnormal: every gradient would be zero) stops the run.
bfloat16 spans float32's range, so nets stored in it run unscaled unless the prototxt asks.

`NonFiniteWatch` finds, when the loss turns Inf or NaN, the first layer whose output did, so the run stops
with a line that names it.
"""
from __future__ import annotations

import math
from typing import Any

from superneurons.errors import UserError
from superneurons.memory.interface import StepHooks

ADAPTIVE_START = 2.0 ** 16
GROWTH_INTERVAL = 1000  # clean iterations before the adaptive scale doubles
SMALLEST = 2.0 ** -24  # float16's smallest subnormal


class LossScale:
    def __init__(self, precision: Any, where: str):
        self.adaptive = bool(precision.adaptive)
        given = float(precision.grad_scale)
        self.scale = ADAPTIVE_START if self.adaptive and given == 1.0 else given
        self.clean = 0  # clean iterations since the last change
        self.where = where

    @property
    def active(self) -> bool:
        return self.adaptive or self.scale != 1.0

    def after_check(self, finite: bool, iteration: int, log: Any) -> bool:
        """Record whether iteration `iteration`'s gradients were finite; whether to apply its update."""
        if not self.adaptive:
            return True
        if not finite:
            self.scale /= 2
            self.clean = 0
            log.info(f"Iteration {iteration}, gradient overflow: update skipped, loss scale lowered to "
                     f"{self.scale:g}")
            if self.scale < SMALLEST:
                raise UserError(f"{self.where}: the adaptive loss scale fell to {self.scale:g}, below 2^-24, at "
                                f"iteration {iteration}: the gradients overflow at any scale (a layer's values "
                                f"exceed float16's range); store that layer in FLOAT (forward_type/backward_type) "
                                f"or train in bfloat16")
            return False
        self.clean += 1
        if self.clean >= GROWTH_INTERVAL:
            self.scale *= 2
            self.clean = 0
            log.info(f"Iteration {iteration}, {GROWTH_INTERVAL} iterations without overflow: loss scale raised to "
                     f"{self.scale:g}")
        return True

    def state(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean}

    def restore(self, state: dict[str, Any], path: str) -> None:
        scale, clean = state.get("scale"), state.get("clean", 0)
        if not isinstance(scale, (int, float)) or not scale > 0 or not isinstance(clean, int) or clean < 0:
            raise UserError(f"{path}: loss_scale must hold a positive scale and a count of clean iterations, "
                            f"got {state!r}")
        self.scale, self.clean = float(scale), clean


class NonFiniteWatch(StepHooks):
    """Remembers the first forward step of a pass whose output holds Inf or NaN (`first`), for the message."""

    def __init__(self, ops: Any, ctx: Any):
        self.ops = ops
        self.ctx = ctx  # the net's RunContext: its scratch region is where the sums add up
        self.first: str | None = None

    def before_forward(self, i: int, step: Any) -> None:
        if i == 0:
            self.first = None

    def after_forward(self, i: int, step: Any) -> None:
        if self.first is None:
            for t in step.tops:
                if t.array is not None and not math.isfinite(self.ops.sumsq(t.array, scratch=self.ctx.scratch)):
                    self.first = step.node.name
                    return


def non_finite_loss(where: str, iteration: int, loss: float, first: str | None) -> UserError:
    layer = f"layer {first!r} was the first to produce Inf or NaN" if first else "no layer output held Inf or NaN"
    return UserError(f"{where}: the loss is {loss} at iteration {iteration} with float16 storage; {layer}; "
                     f"adaptive loss scaling exists for this (global_grad_scale_adaptive: true in the net), or "
                     f"store that layer in FLOAT (forward_type) or train in bfloat16")
