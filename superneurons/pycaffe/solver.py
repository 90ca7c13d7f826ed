"""pycaffe's solvers: `get_solver(path)` and `SGDSolver(path)`, `AdamSolver(path)`, ...

A solver trains the train net its prototxt names and tests its test nets at `test_interval`, printing
Caffe's log lines on stderr, as the `train` command does (the solver's `solver_mode` is ignored: the
device is `set_mode_cpu`/`set_mode_gpu`'s, as in pycaffe). `solver.net` and `solver.test_nets` are
`caffe.Net`s over the nets the solver runs: their blobs and parameters may be read and written between
`step` calls.
"""
from __future__ import annotations

import sys
from typing import Any

from superneurons.errors import UserError, UserTypeError
from superneurons.pycaffe import mode
from superneurons.pycaffe.net import Net


class Solver:
    """A solver of the type the prototxt names (`get_solver`); the subclasses force their type."""

    type_name: str | None = None

    def __init__(self, solver_file: str, memory: str | None = None, gpu_memory: str | int | None = None,
                 precision: str | None = None):
        """`memory`: the memory mode (default: the prototxt's memory_param.mode when set, else baseline, so every
        blob stays readable); `gpu_memory`: the training net's pool size, e.g. '12G'; `precision`: "fp32", "fp16" or
        "bf16" in place of the nets' default storage types."""
        from superneurons.memory.pool import parse_size
        from superneurons.io.prototxt import read_solver
        from superneurons.runtime.logging import TrainLog
        from superneurons.solver.solver import Solver as RuntimeSolver

        param = read_solver(str(solver_file))
        if mode.solver_rank() != 0:  # Caffe's root solver rule: only rank 0 tests, displays and snapshots
            from superneurons.parallel.solver import follower_param

            param = follower_param(param)
        if self.type_name is not None:
            param.type = self.type_name
        if memory is None and not (param.HasField("memory_param") and param.memory_param.HasField("mode")):
            memory = "baseline"
        pool = gpu_memory if isinstance(gpu_memory, int) else parse_size(gpu_memory)
        backend = mode.current_backend()
        self._solver = RuntimeSolver(param, str(solver_file), backend=backend, memory=memory, pool_bytes=pool,
                                     log=TrainLog(stream=sys.stderr), precision=precision)
        self._net = Net._wrap(self._solver.net, backend)
        self._test_nets = [Net._wrap(n, backend) for n in self._solver.test_nets]

    @property
    def net(self) -> Net:
        return self._net

    @property
    def test_nets(self) -> list[Net]:
        return list(self._test_nets)

    @property
    def iter(self) -> int:
        """Updates done so far."""
        return self._solver.iter

    @property
    def param(self) -> Any:
        """The SolverParameter (after upgrading)."""
        return self._solver.param

    @property
    def runtime(self) -> Any:
        """The superneurons.solver Solver underneath."""
        return self._solver

    def _nets(self) -> list[Net]:
        return [self._net] + self._test_nets

    def _run(self, work) -> Any:
        for net in self._nets():
            net._host.push()
        try:
            return work()
        finally:
            for net in self._nets():
                net._host.pull()

    def step(self, iters: int) -> None:
        """Train `iters` iterations (testing and snapshotting when the prototxt says so)."""
        if int(iters) < 0:
            raise UserError(f"step({iters}): the number of iterations cannot be negative")
        self._run(lambda: self._solver.step(int(iters)))

    def solve(self, resume_file: str | None = None) -> None:
        """Train up to max_iter (from a .solverstate when given), as `superneurons train` does."""
        self._run(lambda: self._solver.solve(resume=str(resume_file) if resume_file else None))

    def restore(self, state_file: str) -> None:
        """Continue from a .solverstate: iteration, history and the weights of the model it names."""
        self._run(lambda: self._solver.restore(str(state_file)))

    def snapshot(self) -> None:
        """Write `<prefix>_iter_N.caffemodel` and `.solverstate` now."""
        self._run(self._solver.snapshot)

    def share_weights(self, net: Net) -> None:
        """Make `net` (a Net you built) use this solver's weights for the layers both have, as they train."""
        net.share_with(self._net)

    def test_all(self) -> None:
        """Score every test net now (the log lines Caffe prints at test_interval)."""
        self._run(self._solver.test_all)

    def apply_update(self) -> None:
        """One update of the weights from the gradients they hold now (the rule, learning rate, momentum and
        weight decay of the prototxt), without a forward or backward pass; the iteration stays."""
        self._run(self._solver.apply_update)

    @property
    def lr(self) -> float:
        """The learning rate of the current iteration."""
        return float(self._solver.lr_policy.rate(self._solver.iter))

    def add_callback(self, on_start: Any, on_gradients_ready: Any = None) -> None:
        """`add_callback(on_start, on_gradients_ready)`: two functions of no argument called at the start of
        every iteration and once its gradients are computed, before the update; `add_callback(nccl)`: average
        the gradients across the job's processes there (caffe.NCCL)."""
        if on_gradients_ready is None:
            if not hasattr(on_start, "on_gradients_ready"):
                raise UserTypeError("add_callback(on_start, on_gradients_ready) takes two functions, or one "
                                    "caffe.NCCL")
            callback = on_start
            on_start, on_gradients_ready = callback.on_start, callback.on_gradients_ready
        nets = self._nets()

        def around(fn: Any) -> Any:
            def call() -> None:  # the user's code reads and writes the host arrays
                for net in nets:
                    net._host.pull()
                fn()
                for net in nets:
                    net._host.push()
            return call

        self._solver.on_start.append(around(on_start))
        self._solver.on_gradients_ready.append(around(on_gradients_ready))


# As in pycaffe, every rule is an SGDSolver (`isinstance(solver, caffe.SGDSolver)` holds for Adam's).
class SGDSolver(Solver):
    type_name = "SGD"


class NesterovSolver(SGDSolver):
    type_name = "Nesterov"


class AdaGradSolver(SGDSolver):
    type_name = "AdaGrad"


class RMSPropSolver(SGDSolver):
    type_name = "RMSProp"


class AdaDeltaSolver(SGDSolver):
    type_name = "AdaDelta"


class AdamSolver(SGDSolver):
    type_name = "Adam"


def get_solver(solver_file: str, **kwargs: Any) -> Solver:
    """An instance of the class of the rule the prototxt names (`type`, or the old `solver_type` enum;
    SGD when unset): SGDSolver, AdamSolver, ..."""
    from superneurons.io.prototxt import read_solver

    rule = read_solver(str(solver_file)).type or "SGD"
    classes = {cls.type_name.lower(): cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,
                                                      AdaDeltaSolver, AdamSolver)}
    cls = classes.get(rule.lower(), Solver)  # an unknown rule: the solver names it in its error
    return cls(solver_file, **kwargs)
