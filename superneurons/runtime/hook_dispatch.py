"""The hooks a Net calls around its steps (memory/interface.py: StepHooks), in one list.

The memory manager is the first; others attach with `Net.add_hooks`. `before_*` hooks run in attach order,
so the manager gives a step its memory first; `after_*` hooks in reverse, so it frees memory last and the
others still see what the step computed.
"""
from __future__ import annotations

from typing import Any, Sequence

from superneurons.memory.params import layers_computed_by, param_root


class HookList(list):
    """A list of StepHooks that is itself one: each call goes to every member, in the order above."""

    def before_forward(self, i: int, step: Any) -> None:
        for h in self:
            h.before_forward(i, step)

    def after_forward(self, i: int, step: Any) -> None:
        for h in reversed(self):
            h.after_forward(i, step)

    def before_backward(self, i: int, step: Any) -> None:
        for h in self:
            h.before_backward(i, step)

    def gradients_ready(self, step: Any, params: Sequence[Any]) -> None:
        for h in self:
            h.gradients_ready(step, params)

    def after_backward(self, i: int, step: Any) -> None:
        for h in reversed(self):
            h.after_backward(i, step)


def final_gradient_writers(graph: Any, backward_steps: list[Any], learnable: list[Any]) -> list[list[Any]]:
    """Per backward step, the learnable parameters whose gradients no later step of the pass writes
    (StepHooks.gradients_ready); those no step writes come with the last step."""
    ready: list[list[Any]] = [[] for _ in backward_steps]
    if not ready:
        return ready
    computed_by = layers_computed_by(graph)
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    last: dict[int, int] = {}  # id(learnable decl) -> the last backward step writing its gradient
    for b, step in enumerate(backward_steps):
        for layer in computed_by[index[id(step.node)]]:
            for decl in layer.params:
                last[id(param_root(decl))] = b
    for decl in learnable:
        ready[last.get(id(decl), len(ready) - 1)].append(decl)
    return ready
