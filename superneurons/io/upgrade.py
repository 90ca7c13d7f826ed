"""Upgrading old prototxts to the current format (placeholder for V0/V1 rules: only the current format passes)."""
from __future__ import annotations

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb


def upgrade_net(net: pb.NetParameter, path: str = "<net>") -> pb.NetParameter:
    if len(net.layers):
        raise UserError(f"{path}: V1 'layers' format is not supported yet; use the current 'layer' format")
    return net


def upgrade_solver(solver: pb.SolverParameter, path: str = "<solver>") -> pb.SolverParameter:
    if solver.HasField("solver_type") and not solver.HasField("type"):
        solver.type = pb.SolverParameter.SolverType.Name(solver.solver_type).replace("NESTEROV", "Nesterov").replace(
            "ADAGRAD", "AdaGrad").replace("RMSPROP", "RMSProp").replace("ADADELTA", "AdaDelta").replace("ADAM", "Adam")
    return solver
