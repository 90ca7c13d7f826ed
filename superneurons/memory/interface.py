"""The seam between the Net and the code that decides where its tensors live.

- `StepHooks`: what the Net calls around every forward and backward step, and when a layer's parameter
  gradients are final. The Net's memory manager is the first set of hooks; others (a data-parallel
  gradient all-reduce, a test's counter) attach with `Net.add_hooks`. `before_*` hooks run in attach
  order (the manager first: it gives the step's tensors memory), `after_*` hooks in reverse (the
  manager last: observers still see what the step computed).
- `MemoryManager`: hooks that also own the tensors' memory. `setup()` gives memory to what must have it
  before the first step; the hooks then give and take memory per step. `memory/managers.py` maps the
  `--memory` modes to the managers; `Net(..., memory=SomeManager)` runs any other.
- `NetServices`: what of the Net a manager may use. The one place a tensor gets pool memory is
  `materialize`; `release` gives it back; `run_forward_step` runs a forward step (recomputation replays
  through it).

Hooks receive the step index within its phase (`i`: forward steps 0..F-1, backward steps 0..B-1 in the
order they run) and the `memory.steps.Step` (its layer node and the tensors it reads and writes).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Protocol, Sequence

from superneurons.memory.counters import MovementCounters

if TYPE_CHECKING:
    from superneurons.backend.base import Backend
    from superneurons.graph.build import Graph
    from superneurons.layers.base import ParamDecl
    from superneurons.memory.cost import Choice
    from superneurons.memory.params import OffloadedParams, ResidentParams
    from superneurons.memory.pool import HeapPool, MallocPool
    from superneurons.memory.tensors import TensorLayout
    from superneurons.memory.steps import Step, Tensor
    from superneurons.settings import MemoryPolicy


class StepHooks:
    """Called by the Net around its steps; every hook does nothing unless overridden."""

    def before_forward(self, i: int, step: Step) -> None:
        """Before forward step `i` runs."""

    def after_forward(self, i: int, step: Step) -> None:
        """After forward step `i` has run."""

    def before_backward(self, i: int, step: Step) -> None:
        """Before backward step `i` runs."""

    def after_backward(self, i: int, step: Step) -> None:
        """After backward step `i` has run."""

    def gradients_ready(self, step: Step, params: Sequence[ParamDecl]) -> None:
        """Backward step `step` was the last of this backward pass to write the gradients of `params`.

        `params` are learnable parameters of the solver's list (`Net.learnable`: the owners of shared
        weights), each reported once per backward pass, at the last step that adds into it (a shared
        weight: its last reader's step); those no step writes (their layers run no backward) come with
        the last step. Called right after the layer's backward, before `after_backward`: `decl.diff` is
        the gradient's device array (a streamed parameter's goes home only after this hook returns).
        Device work queued here on the compute stream runs before anything later reads the gradient.
        Under `iter_size` > 1 every pass reports; only the last pass's gradients are the update's."""


class MemoryManager(StepHooks, MovementCounters, ABC):
    """Where the Net's tensors get memory, and when. Subclass it, implement `setup`, override the hooks
    that move memory, and pass the class as `Net(..., memory=YourManager)`."""

    name: ClassVar[str]  # the mode's name, in reports and messages
    # Every tensor keeps its memory from setup on and the hooks do nothing per step, so a pass may be replayed
    # as a recorded CUDA graph (runtime/graph_replay.py).
    static_placement: ClassVar[bool] = False

    def __init__(self, net: NetServices, checkpoint_types: Iterable[str] = (), recompute_limit: int = 0):
        self.net = net
        # The layers whose outputs offload may move and recomputation keeps (reported by every mode).
        self.checkpoint_types: tuple[str, ...] = tuple(checkpoint_types)
        # The bytes a step of a recompute plan may hold before its segment replays step by step (make_plan's
        # `recompute_limit`; `auto` sets it from its budget, 0 plans down to max(l_i)); other modes ignore it.
        self.recompute_limit = recompute_limit
        self.auto: Choice | None = None  # under --memory auto: the choice that picked this manager
        # The store that streams parameters from the host, when this manager decided to (params.py);
        # ResidentParams or None: parameters stay where `setup` placed them.
        self.param_store: OffloadedParams | ResidentParams | None = None

    @abstractmethod
    def setup(self) -> None:
        """Called once, when the pool exists and before any step: give memory to every tensor that must
        have it between steps (at least the parameters, their gradients and the solver history, and the
        inputs data layers write), with `net.materialize`."""

    def ensure(self, tensor: Tensor) -> None:
        """Give `tensor` memory now, outside the step hooks (the loss gradient backward seeds). A manager
        whose `setup` gives every tensor memory for the whole run has nothing to do."""

    def reclaim(self) -> None:
        """Take back memory whose copies have finished, before a convolution sizes its workspace from
        what the pool has free."""

    def alloc_block(self, key: str, nbytes: int, high: bool = False) -> None:
        """A pool block for a streamed parameter (`high`: from the top of the pool); a manager that can
        make room (evict, compact) retries here."""
        self.net.pool.alloc(key, nbytes, high=high)


class NetServices(Protocol):
    """The Net as a memory manager sees it (runtime.net.Net implements it): what the managers of
    memory/managers.py, the parameter stores and `make_manager` use, and nothing else."""

    graph: Graph
    name: str
    train: bool
    backend: Backend
    ops: Any  # the backend's ops namespace
    policy: MemoryPolicy  # the tensor cache, the allocator, parameter streaming (settings.py)
    pool: HeapPool | MallocPool
    layout: TensorLayout  # the tensors' declaration (memory/tensors.py), which the plans are made on
    tensors: list[Tensor]  # in layout order: views after their bases
    learnable: list[ParamDecl]  # the solver's list
    history: list[list[Tensor]]  # solver history: per set, one tensor per learnable parameter
    memory: MemoryManager

    def materialize(self, t: Tensor) -> None:
        """Give root `t` a new pool block (zeroed for gradients and history), or point view `t` at its base."""

    def attach(self, t: Tensor) -> None:
        """Point root `t` at the pool block it already owns under its key (contents unchanged)."""

    def release(self, t: Tensor) -> None:
        """Give `t`'s pool block back (a view just lets go of its array)."""

    def run_forward_step(self, i: int, replay: bool = False) -> None:
        """Run forward step `i` on its tensors' current arrays, its streamed parameters brought in for it.
        `replay`: a recomputation (`ctx.recomputing` is set meanwhile; nothing it writes goes home)."""

    def compact_pool(self) -> bool:
        """Slide the pool's blocks together and re-point the arrays that moved; False if nothing moved."""

    def baseline_bytes(self) -> int:
        """Pool bytes of every root tensor at once."""
