"""Memory managers: what the Net consults before and after every step (the interface: `interface.py`).

`baseline` allocates every tensor once for the whole run. `liveness`, `offload` and `recompute`
(cumulative, as in the paper) execute the per-step plan of `plan.py` (see `managers.py`); `auto`
picks baseline or liveness when one fits the pool, else the mode and checkpoint set whose plan fits and
that `cost.py` predicts fastest. docs/MEMORY.md explains the model.
"""
from __future__ import annotations

from typing import Any, Iterable

from superneurons.errors import UserError
from superneurons.memory.interface import MemoryManager, NetServices, StepHooks  # noqa: F401  (the seam, re-exported)

# The functions below import the planner and the managers when called: every `import superneurons.memory.<x>`
# runs this file first, and the planner imports the graph and with it every layer, which the command line's
# `--help` (through memory.pool's parse_size) must not pay for.

MODES = ("baseline", "liveness", "offload", "recompute", "auto")


# Checkpoint sets `auto` weighs (docs/MEMORY.md, "How auto chooses"): the paper's CONV layers, and the
# block boundaries of ResNet (Eltwise), Inception/DenseNet (Concat) and plain nets (Pooling), which keep
# far fewer bytes and recompute the convolutions inside a block instead of moving their outputs.
BLOCK_CHECKPOINTS: tuple[str, ...] = ("Eltwise", "Concat", "Pooling")
# The time steps of unrolled recurrent layers (layers/recurrent.py): the recurrent state each step leaves
# (LSTMUnit's c_t and h_t; an RNN's h_t and o_t, TanH tops), each step's x_t (the Slice of x) and the first
# step's input transform (the LSTM or RNN layer itself, which also keeps the static input's transform). With
# these kept (recompute) or moved to the host (offload), a step's gate input is rebuilt in backward from that
# step's own tensors, so what stays on the device per step is the state, not the step's activations. That is the
# step form of the input transform, which these modes run (`recurrent_input`); in the sequence form the Slice and
# the layer itself are the whole sequence's transform, (T, N, 4H), kept from the first step to the last.
RECURRENT_CHECKPOINTS: tuple[str, ...] = ("LSTMUnit", "TanH", "Slice", "LSTM", "RNN")
RECURRENT_LAYERS = frozenset({"LSTMUnit", "LSTM", "RNN"})  # the net has unrolled time steps
# The modes whose plans keep checkpoints and drop or move the rest: there each time step of a recurrent layer
# transforms its own input (layers/recurrent.py's step form), so that they keep only the state per step.
CHECKPOINTING_MODES = ("offload", "recompute")


def recurrent_input(mode: str | None) -> str:
    """The form ("sequence" or "step", graph.build's `recurrent_input`) of the recurrent layers' input transform
    for memory mode `mode` (None: auto): SUPERNEURONS_RECURRENT_INPUT's when it names one; else step under
    offload and recompute, and sequence under baseline and liveness, which keep every step's activations
    anyway, and first under auto (`auto_recurrent_inputs`)."""
    from superneurons.settings import get

    setting = get("SUPERNEURONS_RECURRENT_INPUT")
    if setting != "auto":
        return setting
    return "step" if (mode or "auto").lower() in CHECKPOINTING_MODES else "sequence"


def auto_recurrent_inputs() -> tuple[str, ...]:
    """The forms of the recurrent input transform `auto` weighs, in order: it runs the first that has a plan that
    fits (runtime/net.py). The sequence form is the faster; the step form's checkpointing plans keep less (only
    the state per step), so it is where long sequences fit. SUPERNEURONS_RECURRENT_INPUT may name one."""
    from superneurons.settings import get

    setting = get("SUPERNEURONS_RECURRENT_INPUT")
    return ("sequence", "step") if setting == "auto" else (setting,)


def checkpoint_sets(graph: Any, given: Iterable[str] | None = None) -> list[tuple[str, ...]]:
    """The checkpoint sets `auto` considers: the user's only, when given; else the default, always (what
    `--memory offload`/`recompute` run, so auto never refuses a budget they train in; in a net without
    convolutions only the data layers are checkpoints), the block boundaries if one is a layer of the net,
    and the recurrent state if the net has unrolled time steps (data layers are checkpoints in every set)."""
    from superneurons.memory.offload import DEFAULT_CHECKPOINTS

    if given:
        return [tuple(given)]
    present = {n.layer.type_name for n in graph.nodes}
    return ([DEFAULT_CHECKPOINTS] + ([BLOCK_CHECKPOINTS] if present.intersection(BLOCK_CHECKPOINTS) else [])
            + ([RECURRENT_CHECKPOINTS] if present.intersection(RECURRENT_LAYERS) else []))


def pick_mode(net: Any, checkpoint_types: Iterable[str] | None = None, capacity: int | None = None):
    """`auto` for a Net: a `cost.Choice` whose `mode` and `checkpoint_types` fit the Net's pool (`capacity`
    bytes, None: its pool's) beside the resident parameters (or with them streamed) and are predicted
    fastest; a UserError when none fits. `checkpoint_types` given: only those are weighed; None: the sets
    of `checkpoint_sets`."""
    from superneurons.memory.cost import choose
    from superneurons.memory.host import host_limit
    from superneurons.memory.plan import make_plan

    programs: list[Any] = []  # the net's Program, built by the first plan and planned on by the others

    def plan_for(types: tuple[str, ...], modes, recompute_limit: int = 0) -> Any:
        # On the Net's layout: its parameter tensors and solver history are the plan's (plan.layout_param_bytes).
        plan = make_plan(net.graph, train=net.train, plan_backward=False, checkpoint_types=types, modes=modes,
                         layout=net.layout, recompute_limit=recompute_limit, program=next(iter(programs), None))
        programs[:] = [plan.program]
        return plan

    return choose(net.pool.capacity if capacity is None else capacity, checkpoint_sets(net.graph, checkpoint_types),
                  plan_for, host_limit())


def resolve_memory(memory: str | None, memory_param: Any = None, checkpoint_types: Iterable[str] | None = None,
                   unset_types: bool = False) -> tuple[str, tuple[str, ...] | None, int | None]:
    """(mode, checkpoint types, pool bytes or None) from a --memory flag and the solver's MemoryParameter.

    An explicit argument wins; then the MemoryParameter's field when it is set; then the defaults
    (auto, MemoryParameter's default mode; Convolution; the Net's default pool size).
    `unset_types`: None instead of the default types when none were given, so that `auto` may weigh
    several sets (`checkpoint_sets`).
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
    if not types:
        types = None if unset_types else DEFAULT_CHECKPOINTS
    return (mode or "auto").lower(), None if types is None else tuple(types), pool


def make_manager(mode: str | type[MemoryManager], net: NetServices,
                 checkpoint_types: Iterable[str] | None = None, choice: Any = None) -> MemoryManager:
    """The manager for `mode` (or an instance of the MemoryManager class given); `checkpoint_types` are the
    layers whose outputs offload may move and recomputation keeps (None: Convolution, except that `auto`
    then weighs other sets too). Under `auto` the manager's `auto` attribute is the `cost.Choice` made
    (`choice`: the one `pick_mode` already made for this net and pool)."""
    from superneurons.memory.managers import MANAGERS
    from superneurons.memory.offload import DEFAULT_CHECKPOINTS

    net.graph.use_concat_slices(False)  # as built: what auto weighs, and every mode but baseline runs
    if mode != "auto":
        choice = None
    elif choice is None:
        choice = pick_mode(net, checkpoint_types)
    if choice is not None:
        mode, checkpoint_types = choice.mode, choice.checkpoint_types
    types = tuple(checkpoint_types or DEFAULT_CHECKPOINTS)
    # Before any plan of the manager's: ReLUs read their gradients from Concat tops only where every tensor
    # stays resident (graph/fuse.py says why).
    net.graph.use_concat_slices(mode == "baseline")
    if isinstance(mode, type) and issubclass(mode, MemoryManager):
        manager = mode(net, types)
    elif mode in MANAGERS:
        manager = MANAGERS[mode](net, types, recompute_limit=choice.recompute_limit if choice else 0)
    else:
        raise UserError(f"memory mode {mode!r} is not available; choose one of: {', '.join(MODES)}")
    manager.auto = choice
    return manager
