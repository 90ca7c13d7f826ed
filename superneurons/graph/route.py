"""The execution route of the paper's Algorithm 1.

Starting from the layers with no inputs, a depth-first traversal visits a layer only once all
of the layers it joins have been visited (a join counter per layer). The forward route is the
visiting order; the backward route is its reverse. On a linear net this is the prototxt order;
on fans and joins (Inception, ResNet, DenseNet) it finishes one branch before starting the next,
which keeps fewer tensors live at once than breadth-first order.
"""
from __future__ import annotations

from typing import Sequence


def build_route(bottoms: Sequence[Sequence[str]], tops: Sequence[Sequence[str]]) -> list[int]:
    n = len(bottoms)
    producers: dict[str, int] = {}
    preds: list[set[int]] = [set() for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for b in bottoms[i]:
            p = producers[b]  # insert_splits has already checked every bottom has a producer
            if p != i and p not in preds[i]:
                preds[i].add(p)
                succs[p].append(i)
        for t in tops[i]:
            producers[t] = i  # in-place tops make later consumers depend on the in-place layer
    join = [len(p) for p in preds]
    route: list[int] = []
    visited = [False] * n
    # Roots in prototxt order; the stack makes the first root's subtree go first.
    stack = [i for i in reversed(range(n)) if join[i] == 0]
    while stack:
        i = stack.pop()
        if visited[i]:
            continue
        visited[i] = True
        route.append(i)
        ready = []
        for s in succs[i]:
            join[s] -= 1
            if join[s] == 0:
                ready.append(s)
        stack.extend(reversed(ready))
    if len(route) != n:
        raise RuntimeError("net graph has a cycle")  # cannot happen after insert_splits
    return route
