"""Which nets a SolverParameter trains and tests, resolved as Caffe's Solver::InitTrainNet/InitTestNets do.

Train net: exactly one of net_param, net, train_net_param, train_net. Test nets, in Caffe's order:
test_net_param entries, then test_net files, then one instance of the generic net (net/net_param)
for each remaining test_iter entry. Each net's NetState is the prototxt's `state` merged with the
solver's train_state / test_state(i), phase forced to TRAIN / TEST.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from superneurons.errors import UserError
from superneurons.io.prototxt import read_net
from superneurons.proto import superneurons_pb2 as pb


@dataclass
class NetSource:
    param: pb.NetParameter
    where: str  # file name (or "<solver>:field") for messages
    level: int
    stages: tuple[str, ...]


def resolve_net_path(path: str, solver_path: str) -> str:
    """Relative to the working folder like Caffe; failing that, relative to the solver's folder or an ancestor.

    The ancestors matter for model-zoo solvers, whose paths are relative to Caffe's root
    (`net: "examples/mnist/lenet_train_test.prototxt"`).
    """
    if os.path.exists(path) or os.path.isabs(path):
        if not os.path.exists(path):
            raise UserError(f"{solver_path}: net file {path!r} does not exist")
        return path
    folder = os.path.dirname(os.path.abspath(solver_path)) if solver_path else os.getcwd()
    while True:
        candidate = os.path.join(folder, path)
        if os.path.exists(candidate):
            return candidate
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    raise UserError(f"{solver_path}: net file {path!r} does not exist (looked in the working folder and in "
                    f"{os.path.dirname(os.path.abspath(solver_path)) or '.'} and its parents)")


def _state(net: pb.NetParameter, extra: pb.NetState | None) -> tuple[int, tuple[str, ...]]:
    state = pb.NetState()
    state.CopyFrom(net.state)
    if extra is not None:
        state.MergeFrom(extra)
    return int(state.level), tuple(state.stage)


def _load(path: str, solver_path: str, field: str) -> tuple[pb.NetParameter, str]:
    """The net the solver's `field` names; an empty name or a folder is the solver's mistake, said so."""
    if not path.strip():
        raise UserError(f"{solver_path}: {field} is empty; give the path of the net prototxt")
    resolved = resolve_net_path(path, solver_path)
    if os.path.isdir(resolved):
        raise UserError(f"{solver_path}: {field} {path!r} is a folder, not a net prototxt")
    return read_net(resolved), resolved


def train_net_source(param: pb.SolverParameter, solver_path: str) -> NetSource:
    given = [f for f in ("net_param", "net", "train_net_param", "train_net") if param.HasField(f)]
    if not given:
        raise UserError(f"{solver_path}: the solver names no train net; set one of net, net_param, train_net, "
                        "train_net_param")
    if len(given) > 1:
        raise UserError(f"{solver_path}: the solver names the train net more than once ({', '.join(given)}); "
                        "keep one")
    field = given[0]
    if field in ("net", "train_net"):
        net, where = _load(getattr(param, field), solver_path, field)
    else:
        net, where = getattr(param, field), f"{solver_path}:{field}"
    level, stages = _state(net, param.train_state if param.HasField("train_state") else None)
    return NetSource(net, where, level, stages)


def test_net_sources(param: pb.SolverParameter, solver_path: str) -> list[NetSource]:
    generic: tuple[pb.NetParameter, str] | None = None
    if param.HasField("net_param"):
        generic = (param.net_param, f"{solver_path}:net_param")
    elif param.HasField("net"):
        generic = _load(param.net, solver_path, "net")
    specific: list[tuple[pb.NetParameter, str]] = [
        (p, f"{solver_path}:test_net_param[{i}]") for i, p in enumerate(param.test_net_param)]
    specific += [_load(path, solver_path, f"test_net[{i}]") for i, path in enumerate(param.test_net)]
    n_iter = len(param.test_iter)
    if generic is not None:
        if n_iter < len(specific):
            raise UserError(f"{solver_path}: {len(specific)} test nets but only {n_iter} test_iter value(s); "
                            "give test_iter for each test net")
    elif n_iter != len(specific):
        raise UserError(f"{solver_path}: {len(specific)} test net(s) but {n_iter} test_iter value(s); they must match")
    nets = specific + [generic] * (n_iter - len(specific))  # type: ignore[list-item]
    if len(param.test_state) and len(param.test_state) != len(nets):
        raise UserError(f"{solver_path}: {len(param.test_state)} test_state value(s) for {len(nets)} test net(s)")
    out = []
    for i, (net, where) in enumerate(nets):
        extra = param.test_state[i] if len(param.test_state) else None
        level, stages = _state(net, extra)
        out.append(NetSource(net, where, level, stages))
    return out
