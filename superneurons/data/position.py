"""The data position of a whole net, for snapshots: every data layer's `state()`, by layer name.

A solver calls `net_data_state(net)` when it writes a snapshot and `restore_net_data_state(net, s)`
when it resumes; the state is small and JSON-serializable ({"mnist": {"batch": 1500}}).
"""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError


def _stateful_layers(net: Any):
    for node in net.graph.nodes:
        layer = node.layer
        if callable(getattr(layer, "state", None)) and callable(getattr(layer, "restore", None)):
            yield layer


def net_data_state(net: Any) -> dict[str, dict[str, int]]:
    return {layer.name: layer.state() for layer in _stateful_layers(net)}


def restore_net_data_state(net: Any, states: dict[str, dict[str, int]]) -> None:
    """Put every data layer at its saved position; a layer the snapshot does not mention is an error."""
    for layer in _stateful_layers(net):
        if layer.name not in states:
            raise UserError(f"the snapshot has no data position for layer {layer.name!r} "
                            f"(it has: {', '.join(sorted(states)) or 'none'})")
        layer.restore(states[layer.name])


def close_data_layers(net: Any) -> None:
    """Stop every prefetch thread of `net` (they also stop when the net is garbage collected)."""
    for node in net.graph.nodes:
        close = getattr(node.layer, "close", None)
        if callable(close):
            close()
