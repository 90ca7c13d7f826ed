"""Caffe's include/exclude rules: which layers a net has in a given phase, level and stages."""
from __future__ import annotations

from typing import cast

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb


def make_state(phase: int, level: int = 0, stages: tuple[str, ...] = ()) -> pb.NetState:
    # Any value of the Phase enum will do, as the int it is; the stubs name the enum's type only.
    state = pb.NetState(phase=cast(pb.Phase, phase), level=level)
    state.stage.extend(stages)
    return state


def meets_rule(state: pb.NetState, rule: pb.NetStateRule) -> bool:
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def is_included(layer: pb.LayerParameter, state: pb.NetState) -> bool:
    """Whether `layer` is part of the net in `state` (its include rules, else its exclude rules)."""
    if len(layer.include) and len(layer.exclude):
        raise UserError(f"layer {layer.name!r}: specify either include or exclude rules, not both")
    if len(layer.include):
        return any(meets_rule(state, r) for r in layer.include)
    return not any(meets_rule(state, r) for r in layer.exclude)


def filter_net(net: pb.NetParameter, state: pb.NetState) -> pb.NetParameter:
    """A copy of `net` holding only the layers included in `state`."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    for layer in net.layer:
        if is_included(layer, state):
            out.layer.add().CopyFrom(layer)
    out.state.CopyFrom(state)
    return out
