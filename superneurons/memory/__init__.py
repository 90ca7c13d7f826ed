"""Memory managers: what the Net consults before and after every step.

`baseline` allocates every tensor once for the whole run. The other modes (liveness, offload,
recompute, auto) are built on the same hooks.
"""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError

MODES = ("baseline", "liveness", "offload", "recompute", "auto")


class BaselineManager:
    """Every tensor allocated up front and kept for the whole run: the reference every mode must match."""

    name = "baseline"

    def __init__(self, net: Any):
        self.net = net

    def setup(self) -> None:
        net = self.net
        for t in net.tensors:
            if t.base is None:
                net._materialize(t)
        for t in net.tensors:
            if t.base is not None:
                net._materialize(t)

    # The hooks: nothing moves under baseline.
    def before_forward(self, i: int, step: Any) -> None:
        pass

    def after_forward(self, i: int, step: Any) -> None:
        pass

    def before_backward(self, i: int, step: Any) -> None:
        pass

    def after_backward(self, i: int, step: Any) -> None:
        pass

    def ensure(self, tensor: Any) -> None:
        pass


def make_manager(mode: str, net: Any):
    if mode == "baseline":
        return BaselineManager(net)
    raise UserError(f"memory mode {mode!r} is not available; choose one of: baseline")
