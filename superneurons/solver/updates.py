"""The six update rules: which history blobs each keeps and which fused backend op applies it.

A rule is told the parameter's data and (already regularized) diff, its history arrays and the
local rate (lr * lr_mult), and calls one backend op. History layout follows Caffe's .solverstate:
one blob per learnable parameter, and for AdaDelta and Adam a second full set after the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb

# (ops, w, dw, hists, local_rate, solver param, iteration) -> None
ApplyFn = Callable[[Any, Any, Any, Sequence[Any], float, pb.SolverParameter, int], None]


@dataclass(frozen=True)
class UpdateRule:
    name: str
    n_history: int  # history sets per learnable parameter
    apply: ApplyFn


def _sgd(ops, w, dw, h, rate, p, it):
    ops.sgd_update(w, dw, h[0], rate, p.momentum)


def _nesterov(ops, w, dw, h, rate, p, it):
    ops.nesterov_update(w, dw, h[0], rate, p.momentum)


def _adagrad(ops, w, dw, h, rate, p, it):
    ops.adagrad_update(w, dw, h[0], rate, p.delta)


def _rmsprop(ops, w, dw, h, rate, p, it):
    ops.rmsprop_update(w, dw, h[0], rate, p.rms_decay, p.delta)


def _adadelta(ops, w, dw, h, rate, p, it):
    ops.adadelta_update(w, dw, h[0], h[1], rate, p.momentum, p.delta)


def _adam(ops, w, dw, h, rate, p, it):
    ops.adam_update(w, dw, h[0], h[1], rate, p.momentum, p.momentum2, p.delta, it + 1)


RULES = {r.name: r for r in (
    UpdateRule("SGD", 1, _sgd),
    UpdateRule("Nesterov", 1, _nesterov),
    UpdateRule("AdaGrad", 1, _adagrad),
    UpdateRule("RMSProp", 1, _rmsprop),
    UpdateRule("AdaDelta", 2, _adadelta),
    UpdateRule("Adam", 2, _adam),
)}


def get_rule(param: pb.SolverParameter, where: str = "<solver>") -> UpdateRule:
    """The rule for `param.type`, after checking the settings Caffe checks for it."""
    name = param.type or "SGD"
    rule = RULES.get(name)
    if rule is None:
        raise UserError(f"{where}: unknown solver type {name!r}; known: {', '.join(RULES)}")
    if name == "AdaGrad" and param.momentum != 0:
        raise UserError(f"{where}: AdaGrad does not use momentum (got momentum: {param.momentum:g})")
    if name == "RMSProp" and param.momentum != 0:
        raise UserError(f"{where}: RMSProp does not use momentum (got momentum: {param.momentum:g})")
    if name == "RMSProp" and not 0.0 <= param.rms_decay < 1.0:
        raise UserError(f"{where}: rms_decay must be in [0, 1), got {param.rms_decay:g}")
    if param.regularization_type not in ("L1", "L2"):
        raise UserError(f"{where}: unknown regularization_type {param.regularization_type!r}; known: L1, L2")
    return rule
