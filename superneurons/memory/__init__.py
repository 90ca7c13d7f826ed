"""Memory managers: what the Net consults before and after every step.

`baseline` allocates every tensor once for the whole run. `liveness`, `offload` and `recompute`
(cumulative, as in the paper) execute the per-step plan of `plan.py` (see `managers.py`); `auto`
picks the cheapest of them whose planned peak fits the pool. docs/MEMORY.md explains the model.
"""
from __future__ import annotations

from typing import Any, Iterable

from superneurons.errors import UserError
from superneurons.memory.counters import MovementCounters

MODES = ("baseline", "liveness", "offload", "recompute", "auto")


class BaselineManager(MovementCounters):
    """Every tensor allocated up front and kept for the whole run: the reference every mode must match."""

    name = "baseline"

    def __init__(self, net: Any):
        self.net = net

    def setup(self) -> None:
        net = self.net
        need = net.baseline_bytes()
        if need > net.pool.capacity:  # say so before anything is placed, with the bytes a mode would need
            from superneurons.memory.pool import format_bytes

            raise UserError(f"a {net.pool.capacity}-byte pool ({format_bytes(net.pool.capacity)}) cannot train "
                            f"{net.name or 'this net'} under --memory baseline, which holds every tensor at once: "
                            f"{need} bytes ({format_bytes(need)}); give a larger pool/--gpu-memory or --memory auto")
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


def pick_mode(net: Any, checkpoint_types: Iterable[str] | None = None) -> str:
    """`auto`: the cheapest mode whose planned peak, plus the resident parameters, fits the Net's pool."""
    from superneurons.memory.offload import DEFAULT_CHECKPOINTS
    from superneurons.memory.plan import make_plan

    plan = make_plan(net.graph, train=net.train, plan_backward=False,
                     checkpoint_types=checkpoint_types or DEFAULT_CHECKPOINTS)
    from superneurons.memory.pool import round_up

    # The Net's own parameter tensors (shared ones are declared once) and solver history, as the pool holds them.
    plan.param_bytes = sum(round_up(t.nbytes) for t in net.tensors
                           if t.base is None and t.kind in ("param", "param_diff", "history"))
    plan.update_bytes = max((round_up(d.data_tensor.nbytes) * 2 + sum(round_up(h[i].nbytes) for h in net.history)
                             for i, d in enumerate(net.learnable)), default=0)
    return plan.pick(net.pool.capacity)


def resolve_memory(memory: str | None, memory_param: Any = None, checkpoint_types: Iterable[str] | None = None
                   ) -> tuple[str, tuple[str, ...], int | None]:
    """(mode, checkpoint types, pool bytes or None) from a --memory flag and the solver's MemoryParameter.

    An explicit argument wins; then the MemoryParameter's field when it is set; then the defaults
    (auto -- MemoryParameter's default mode, issue #4 --, Convolution, the Net's default pool size).
    """
    from superneurons.memory.offload import DEFAULT_CHECKPOINTS

    mode, types, pool = memory, checkpoint_types, None
    if memory_param is not None:
        if mode is None and memory_param.HasField("mode"):
            mode = type(memory_param).Mode.Name(memory_param.mode).lower()
        if types is None and len(memory_param.checkpoint_type):
            types = tuple(memory_param.checkpoint_type)
        if memory_param.pool_bytes > 0:
            pool = int(memory_param.pool_bytes)
    return (mode or "auto").lower(), tuple(types or DEFAULT_CHECKPOINTS), pool


def make_manager(mode: str, net: Any, checkpoint_types: Iterable[str] | None = None):
    """The manager for `mode`; `checkpoint_types` (default: Convolution) are the layers whose outputs
    offload may move and recomputation keeps."""
    from superneurons.memory.managers import MANAGERS
    from superneurons.memory.offload import DEFAULT_CHECKPOINTS

    types = tuple(checkpoint_types or DEFAULT_CHECKPOINTS)
    if mode == "auto":
        mode = pick_mode(net, types)
    if mode == "baseline":
        return BaselineManager(net)
    if mode in MANAGERS:
        return MANAGERS[mode](net, types)
    raise UserError(f"memory mode {mode!r} is not available; choose one of: {', '.join(MODES)}")
