"""Gradient aliasing: layers whose backward only forwards or sums gradients write no gradient of their own.

The layers say which they are (`Layer.sums_top_diffs`, `Layer.identity_diff_bottoms`,
`Layer.diff_in_place_bottoms`):
- **Summing top gradients** (Split; bottom b, tops t_0..t_n-1): b's gradient is the sum of the tops'
  gradients. The bottom gradient shares the memory of one top gradient t_a@diff and the others are added
  into it (Caffe overwrites bottom gradients, so the sum *is* the value it would have written).
- **Passing the top gradient on** (Eltwise SUM with coefficient 1 for bottom j): bottom j's gradient equals
  the top gradient, so it is the top gradient's memory and backward writes nothing for it.
- **Computing over the top gradient** (the fused BatchNorm out of place, `Layer.diff_in_place_bottoms`):
  backward writes the bottom gradient over the top gradient, which it reads element by element first, as
  in place; the same views as passing it on.
- **Accumulating consumers of a Split top**: a consumer that can add its bottom gradient into memory
  (`Layer.can_accumulate_bottom_diff`: Convolution, cuDNN's beta = 1) and runs after top a's consumers in
  backward writes straight into the bottom gradient, which then already holds top a's share; Split skips
  that top. Without it a ResNet's projection block holds two input-sized gradients at once (the sum and
  the second convolution's output), 1.17x max(l_i) under recompute; with it, none beyond max(l_i).

`tensors.declare_tensors` asks `diff_aliases` which top gradients become views of which bottom gradients,
and the planner (`liveness.Program`) and the runtime (`runtime.net.Net`) share that layout, so they agree on
the roots. The layers learn it from their arguments: the runtime passes a top gradient that shares a bottom
gradient's memory as that bottom gradient's array (as an in-place layer's are one array), and tells an
accumulating consumer which bottom gradients to add into (backward's `accumulate`). The layers asked here
are the ones the steps run (`Graph.step_layer`: a fused layer where graph/fuse.py rewrote the step).

An alias is only taken when it is provably safe, with the same arithmetic in every memory mode:
- the shared memory is (re)written every iteration before the aliasing layer's backward reads it: some
  later consumer of the top overwrites its gradient (`_rewritten`); otherwise baseline, which never
  re-zeroes gradients, would read last iteration's value;
- nothing else writes the bottom's gradient in the window: the aliasing layer is the bottom's last
  consumer (in-place layers before it run *after* it in backward, when the top gradient is dead);
- no loss seeds either gradient, no blob name repeats among the layer's bottoms or tops.
The graph's `diff_alias` (memory_param's, or SUPERNEURONS_DIFF_ALIAS=0) turns aliasing off: every mode then
sums into separate memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from superneurons.graph.build import Graph


@dataclass
class DiffAliases:
    """`views[top blob] = bottom blob`: the top's gradient is a view of the bottom's gradient.
    `index[node name]`: a layer summing top gradients (Split) -> the top whose gradient memory is the bottom
    gradient; one passing it on (Eltwise) -> the bottom whose gradient memory is the top gradient. `added[split name]`: the tops whose consumers add
    their gradient into the bottom gradient themselves; `accumulate[consumer name]`: those consumers'
    bottom indexes that do so."""

    views: dict[str, str] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    added: dict[str, tuple[int, ...]] = field(default_factory=dict)
    accumulate: dict[str, frozenset[int]] = field(default_factory=dict)


def diff_aliases(graph: Graph, need_backward: dict[str, bool], propagate_down: dict[str, list[bool]],
                 seeds: Iterable[str]) -> DiffAliases:
    """The gradient aliases of `graph` under the given backward flags; `seeds` are the blobs whose
    gradients the loss fills before backward."""
    out = DiffAliases()
    if not graph.diff_alias:
        return out
    nodes = graph.nodes
    seeded = set(seeds)
    consumers: dict[str, list[int]] = {}  # blob -> route indexes of the nodes reading it
    first_seen: dict[str, int] = {}  # blob -> first route index naming it (as top or bottom)
    # node -> the bottoms its backward writes a gradient of (a set: a Concat of T time steps reads T blobs)
    propagated: dict[str, set[str]] = {}
    for i, n in enumerate(nodes):
        for b in n.bottoms:
            consumers.setdefault(b, []).append(i)
            first_seen.setdefault(b, i)
        for t in n.tops:
            first_seen.setdefault(t, i)
        propagated[n.name] = {b for b, pd in zip(n.bottoms, propagate_down[n.name]) if pd}

    def rewritten(blob: str, after: int) -> bool:
        """Some consumer after route index `after` overwrites `blob`'s gradient in every backward pass (an
        in-place one only transforms what is there, so it does not count; a Flatten or Reshape writes
        nothing itself, its top's gradient being a view of its bottom's: it counts when that is rewritten)."""
        for c in consumers.get(blob, ()):
            node = nodes[c]
            if c <= after or not need_backward[node.name] or blob in node.tops:
                continue
            if blob not in propagated[node.name]:
                continue
            if not node.layer.shares_diff or any(rewritten(t, c) for t in node.tops):
                return True
        return False

    def last_consumer(blob: str, i: int) -> bool:
        return max(consumers.get(blob, [i])) == i and nodes[i].bottoms.count(blob) == 1

    def fresh_top(t: str, i: int) -> bool:
        """Top `t` of node `i` gets a gradient of its own that is rewritten before node i's backward."""
        return first_seen[t] == i and t not in seeded and nodes[i].tops.count(t) == 1 and rewritten(t, i)

    def accumulator(t: str, i: int, before: int) -> tuple[int, int] | None:
        """(route index, bottom index) of the one consumer of top `t` of node `i`, when it can add its
        gradient into the shared memory: it reads `t` once, not in place, needs its gradient, and runs in
        backward after every node with route index >= `before` (those write the shared memory first)."""
        users = consumers.get(t, [])
        if len(users) != 1 or first_seen[t] != i or t in seeded or nodes[i].tops.count(t) != 1:
            return None
        c = users[0]
        node = nodes[c]
        layer = graph.step_layer(node)
        if c >= before or not layer.can_accumulate_bottom_diff or not need_backward[node.name]:
            return None
        if t in node.tops or node.bottoms.count(t) != 1 or layer.in_place:
            return None
        j = node.bottoms.index(t)
        return (c, j) if propagate_down[node.name][j] else None

    for i, n in enumerate(nodes):
        layer = graph.step_layer(n)
        pdown = propagate_down[n.name]
        if not need_backward[n.name] or layer.in_place:
            continue
        passed_on = layer.identity_diff_bottoms() or layer.diff_in_place_bottoms()
        if layer.sums_top_diffs and len(n.tops) >= 2 and pdown[0]:
            b = n.bottoms[0]
            if b in seeded or not last_consumer(b, i):
                continue
            # The top read last in forward is written first in backward: its gradient becomes the sum's
            # memory, so the consumers of the other tops (earlier in forward) can add into it.
            fresh = [k for k, t in enumerate(n.tops) if fresh_top(t, i)]
            a = max(fresh, key=lambda k: min(consumers[n.tops[k]])) if fresh else None
            if a is not None:
                out.views[n.tops[a]] = b
                out.index[n.name] = a
                added = []
                for k, t in enumerate(n.tops):
                    acc = None if k == a else accumulator(t, i, min(consumers[n.tops[a]]))
                    if acc is not None:
                        out.views[t] = b
                        added.append(k)
                        node = nodes[acc[0]].name
                        out.accumulate[node] = out.accumulate.get(node, frozenset()) | {acc[1]}
                if added:
                    out.added[n.name] = tuple(added)
        elif passed_on:
            t = n.tops[0]
            if not fresh_top(t, i):
                continue
            j = next((k for k, b in enumerate(n.bottoms)
                      if pdown[k] and k in passed_on and b not in seeded and last_consumer(b, i)), None)
            if j is not None:
                out.views[t] = n.bottoms[j]
                out.index[n.name] = j
    return out

