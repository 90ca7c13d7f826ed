"""The training loop: Caffe's Solver::Solve/Step/ApplyUpdate/TestAll, with its log lines.

One iteration: clear the parameter diffs; run forward+backward `iter_size` times (diffs add
up); then update: clip by the global L2 norm, divide by iter_size, add weight decay, apply the
solver type's rule with local rate lr * lr_mult. `iter` counts completed updates, so a snapshot
taken at iteration N holds the weights after N updates. Where fused_update.py applies (resident
parameters, SGD), clearing and updating are one grouped op each instead of a few ops per parameter.

`net.ctx.iteration` is the forward-pass index, `iter * iter_size + k` for the k-th pass of an
iteration: the accumulated passes of one iteration see different batches (DummyData, Dropout
masks), and with iter_size 1 it equals the iteration.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

from superneurons.backend import get_backend
from superneurons.dtypes import FLOAT32
from superneurons.graph.build import build_graph
from superneurons.graph.precision import STORAGE_TYPES, override_defaults
from superneurons.errors import UserError
from superneurons.io.caffemodel import load_weights_files
from superneurons.layers.base import count
from superneurons.memory import recurrent_input, resolve_memory
from superneurons.memory.pool import format_bytes
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.logging import DisplayGate, TrainLog, capped_outputs, num, output_line
from superneurons.runtime.net import Net
from superneurons.settings import memory_policy
from superneurons.solver.evaluate import evaluate, output_values, score_blobs
from superneurons.solver import fused_update
from superneurons.solver.fused_update import grouped_update
from superneurons.solver.loss_scale import LossScale, NonFiniteWatch, non_finite_loss
from superneurons.solver.lr_policy import LrPolicy
from superneurons.solver.nets import NetSource, test_net_sources, train_net_source
from superneurons.solver.signals import SignalEffects
from superneurons.solver.snapshot import (remove_leftovers, resolve_prefix, restore_snapshot, snapshot_paths,
                                          write_snapshot)
from superneurons.solver.updates import get_rule

# Called after every iteration with (solver, iteration just completed, its loss): the progress-bar hook.
IterationCallback = Callable[["Solver", int, float], None]


def clock_seed() -> int:
    return time.time_ns() % (1 << 31)


class Solver:
    steps_hooked = False  # the training net gets hooks that run every step (a subclass's gradient reducer)

    def __init__(self, param: pb.SolverParameter, solver_path: str = "", *, backend: Any = None,
                 memory: str | None = None, pool_bytes: int | None = None, log: TrainLog | None = None,
                 signals: SignalEffects | None = None, precision: str | None = None,
                 data_workers: int | None = None):
        """`memory`: the mode (None: the solver's `memory_param.mode`, whose default is auto).
        `pool_bytes`: the training net's pool size in bytes, what `--gpu-memory` gives (None:
        `memory_param.pool_bytes` when set, else the Net's default). Test nets size their own pools.
        `signals`: what SIGINT/SIGHUP do during `solve` (default Caffe's: SIGINT stops, SIGHUP snapshots).
        `precision`: "fp32", "fp16" or "bf16" overrides the nets' default storage types (graph/precision.py).
        `data_workers`: decode worker processes of every data layer of its nets (--data-workers)."""
        self.precision = precision
        self.data_workers = data_workers
        self.param = param
        self.pool_bytes = pool_bytes
        self.where = solver_path or "<solver>"
        self.rule = get_rule(param, self.where)
        self.lr_policy = LrPolicy(param, self.where)
        self.log = log if log is not None else TrainLog()
        self.signals = signals if signals is not None else SignalEffects(say=self.log.warning)
        self.display_gate = DisplayGate()
        self.backend = backend if backend is not None else get_backend("cpu")
        self.ops = self.backend.ops
        self.seed = int(param.random_seed) if param.random_seed >= 0 else clock_seed()
        self.prefix = resolve_prefix(param, solver_path)
        self.iter = 0
        self.iter_size = max(1, int(param.iter_size))
        self.callbacks: list[IterationCallback] = []
        # Caffe's Solver::Callback (pycaffe's add_callback, NCCL): functions of no argument called at the start
        # of every iteration, and once its gradients are computed, before the update.
        self.on_start: list[Callable[[], None]] = []
        self.on_gradients_ready: list[Callable[[], None]] = []
        self.net = self._build(train_net_source(param, self.where), pb.TRAIN, memory)
        self.test_nets = [self._build(src, pb.TEST, memory, share=self.net)
                          for src in test_net_sources(param, self.where)]
        self.test_passes = [0] * len(self.test_nets)  # forward passes each test net has run (its data position)
        self._history = self.net.history  # pool tensors (zeroed), `n_history` sets of one per learnable param
        self.loss_scale = LossScale(self.net.graph.precision, self.net.graph.source or self.where)
        # Where float16 storage runs without adaptive scaling, an Inf or NaN loss stops the run naming the layer.
        self._watch: NonFiniteWatch | None = None
        if self.net.graph.precision.float16 and not self.loss_scale.adaptive:
            self._watch = NonFiniteWatch(self.ops, self.net.ctx)
            self.net.add_hooks(self._watch)
        # One launch for the whole update and one for clearing the gradients, where it applies (else None:
        # the per-parameter ops; solver/fused_update.py says when: float32 masters; a loss scale is divided out
        # with 1/iter_size, as the per-parameter update divides it).
        plain = self.net.graph.precision.master == FLOAT32
        self._grouped = grouped_update(self.net, self.rule.name, param) if plain else None
        self._losses: list[float] = []
        self.smoothed_loss = 0.0
        self._stop_requested = False

    # -- construction -------------------------------------------------------------------------
    def _build(self, src: NetSource, phase: int, memory: str | None, share: Net | None = None) -> Net:
        memory_param = self.param.memory_param if self.param.HasField("memory_param") else None
        net_param = override_defaults(_copy(src.param), self.precision)
        # In the form of the recurrent input transform the mode runs, so that the Net need not build it again
        mode = resolve_memory(memory, memory_param)[0]
        graph = build_graph(net_param, phase, src.level, src.stages, source=src.where,
                            policy=memory_policy(memory_param), recurrent_input=recurrent_input(mode))
        graph.precision.master = master_type(self.param, self.where)
        # The budget is the training net's; a test net (sharing its parameters) sizes its pool to its need.
        pool = self.pool_bytes if share is None else None
        train = phase == pb.TRAIN
        return Net(graph, self.backend, train=train, seed=self.seed, share_params_with=share,
                   memory=memory, memory_param=memory_param, pool_bytes=pool,
                   solver_history=self.rule.n_history if train else 0, data_workers=self.data_workers,
                   update_chunk=fused_update.CHUNK if train and graph.precision.master == FLOAT32
                   and fused_update.wanted(self.rule.name) else 0,
                   reduce_type=self.gradient_reduce_type(graph) if train else None,
                   eager=train and self.steps_hooked)

    def gradient_reduce_type(self, graph: Any) -> Any:
        """The half type the training net's gradients are reduced in across ranks (None: no reduction, or in
        their own type); a data-parallel solver decides (parallel/solver.py)."""
        return None

    def all_nets(self) -> list[tuple[str, Net]]:
        return [("train", self.net)] + [(f"test{i}", n) for i, n in enumerate(self.test_nets)]

    def history_blobs(self) -> list[Any]:
        """Caffe's .solverstate order: the first history set for every parameter, then the second set.
        (With streamed parameters these are the host copies, current between iterations.)"""
        return [h.array for hist_set in self._history for h in hist_set]

    def set_seed(self, seed: int) -> None:
        self.seed = seed
        for _, net in self.all_nets():
            net.ctx.seed = seed

    def load_weights(self, paths: str) -> None:
        """`--weights a,b`: fine-tune from these models (train net, and test-only layers of test nets)."""
        for line in load_weights_files(self.net, paths):
            self.log.info(line)
        for net in self.test_nets:
            load_weights_files(net, paths)

    def restore(self, state_path: str) -> None:
        self.log.info(f"Restoring previous solver status from {state_path}")
        restore_snapshot(self, state_path)

    # -- the loop -----------------------------------------------------------------------------
    def solve(self, resume: str | None = None) -> None:
        p = self.param
        self.log.info(f"Solving {self.net.name}")
        self.log.info(f"Learning Rate Policy: {self.lr_policy.name}")
        self.log.info(memory_line(self.net))
        for path in remove_leftovers(self):
            self.log.info(f"Removed {path}, a temporary snapshot file left by an interrupted run")
        if resume:
            self.restore(resume)
        if p.random_seed < 0:
            self.log.info(f"Random seed: {self.seed} (from the clock; set random_seed to repeat this run)")
        start_iter = self.iter
        release = self.signals.install()
        try:
            self.step(p.max_iter - self.iter)
        finally:
            release()
        snapshotted = bool(p.snapshot) and self.iter % p.snapshot == 0
        if p.snapshot_after_train and not snapshotted:
            self.snapshot()
            snapshotted = True
        if self._stop_requested:  # Caffe's words, then where to resume from
            state_path = snapshot_paths(self.prefix, self.iter, p.snapshot_format == pb.SolverParameter.HDF5)[1]
            self.log.info("Optimization stopped early." + (f" Resume with --snapshot {state_path}" if snapshotted
                                                           else " (no snapshot: snapshot_after_train is off)"))
            return
        if p.display and self.iter % p.display == 0:
            self.net.ctx.iteration = self.iter * self.iter_size
            loss = self.net.forward()
            self._update_smoothed_loss(loss, start_iter)
            self.log.info(f"Iteration {self.iter}, loss = {num(self.smoothed_loss)}")
            self.log.record(event="train", iter=self.iter, loss=self.smoothed_loss)
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        self.log.info("Optimization Done.")

    def step(self, iters: int) -> None:
        p = self.param
        start_iter = self.iter
        stop_iter = self.iter + iters
        self._losses = []
        self.smoothed_loss = 0.0
        timer, iters_last = time.perf_counter(), self.iter
        while self.iter < stop_iter and not self._stop_requested:
            net = self.net
            net.clear_param_diffs(already_zero=self._grouped is not None and self._grouped.clear_grads())
            if p.test_interval and self.iter % p.test_interval == 0 and (self.iter > 0 or p.test_initialization):
                self.test_all()
            for call in self.on_start:
                call()
            display = bool(p.display) and self.iter % p.display == 0 and self._display_allowed()
            loss = 0.0
            net.loss_scale = self.loss_scale.scale
            for k in range(self.iter_size):
                net.ctx.iteration = self.iter * self.iter_size + k
                loss += net.forward_backward()
            loss /= self.iter_size
            if self._watch is not None and not math.isfinite(loss):
                raise non_finite_loss(self.net.graph.source or self.where, self.iter, loss, self._watch.first)
            self._update_smoothed_loss(loss, start_iter)
            if display:
                lapse = time.perf_counter() - timer
                per_s = (self.iter - iters_last) / lapse if lapse > 0 else 0.0
                self._display(lapse, per_s)
                timer, iters_last = time.perf_counter(), self.iter
            for call in self.on_gradients_ready:
                call()
            self.apply_update(display)
            self.iter += 1
            for callback in self.callbacks:
                callback(self, self.iter, loss)
            action = self.signals.take()  # Caffe's order: the interval snapshot or a requested one, then stop
            if (p.snapshot and self.iter % p.snapshot == 0) or action == "snapshot":
                self.snapshot()
            if action == "stop":
                self.request_stop()

    def _display_allowed(self) -> bool:
        """False for displays beyond what DisplayGate lets through; says so once."""
        if self.display_gate.allow():
            return True
        if not self.display_gate.thinned:
            self.display_gate.thinned = True
            self.log.info(f"Iteration {self.iter}: displays come faster than {self.display_gate.per_second:g} a "
                          f"second (display: {self.param.display}); showing at most that many from here on, "
                          "training is unaffected")
        return False

    def _display(self, lapse: float, per_s: float) -> None:
        self.log.info(f"Iteration {self.iter} ({num(per_s)} iter/s, {num(lapse)}s/{self.param.display} iters), "
                      f"loss = {num(self.smoothed_loss)}")
        values, notes = capped_outputs(output_values(self.net))
        for index, name, value, weight in values:
            self.log.info(output_line("Train", index, name, value, weight))
        for note in notes:
            self.log.info(note)
        self.log.record(event="train", iter=self.iter, loss=self.smoothed_loss, lr=self.lr_policy.rate(self.iter),
                        iter_per_s=per_s, outputs=_named([(name, value) for _, name, value, _ in values]))

    def _update_smoothed_loss(self, loss: float, start_iter: int) -> None:
        """Caffe's running mean over the last `average_loss` iterations."""
        window = max(1, int(self.param.average_loss))
        if len(self._losses) < window:
            self._losses.append(loss)
            n = len(self._losses)
            self.smoothed_loss = (self.smoothed_loss * (n - 1) + loss) / n
        else:
            idx = (self.iter - start_iter) % window
            self.smoothed_loss += (loss - self._losses[idx]) / window
            self._losses[idx] = loss

    # -- the update ---------------------------------------------------------------------------
    def apply_update(self, display: bool = False) -> float:
        p = self.param
        rate = self.lr_policy.rate(self.iter)
        if display:
            self.log.info(f"Iteration {self.iter}, lr = {num(rate)}")
        store = self.net.params
        if self.loss_scale.adaptive and not self.loss_scale.after_check(self._gradients_finite(store), self.iter,
                                                                         self.log):
            return rate  # an overflow: the step is skipped (the gradients are cleared before the next)
        if store.offloaded:
            self._update_streamed(store, rate, display and p.debug_info)
            return rate
        clip_scale = self.clip_gradients()
        if self._grouped is None or not self._grouped.update(rate, clip_scale, self.iter_size, self.loss_scale.scale):
            for i, decl in enumerate(self.net.learnable):
                self._update_one(i, decl, rate, clip_scale)
        if display and p.debug_info:
            self._update_debug_info()
        return rate

    def _update_one(self, i: int, decl: Any, rate: float, clip_scale: float) -> None:
        """Caffe's ApplyUpdate for one parameter: clip, normalize by iter_size, regularize, the rule."""
        p, ops = self.param, self.ops
        if clip_scale != 1.0:
            ops.scal(clip_scale, decl.diff)
        if self.iter_size > 1 or self.loss_scale.scale != 1.0:  # the mean over passes, without the loss scale
            ops.scal(1.0 / self.iter_size / self.loss_scale.scale, decl.diff)
        decay = float(p.weight_decay) * decl.decay_mult
        if decay:
            ops.regularize(decl.data, decl.diff, decay, p.regularization_type == "L1")
        hists = [hist_set[i].array for hist_set in self._history]
        self.rule.apply(ops, decl.data, decl.diff, hists, rate * decl.lr_mult, p, self.iter)

    def _update_streamed(self, store: Any, rate: float, debug: bool) -> None:
        """The update when parameters live on the host between uses: one parameter at a time on the
        device (its data, gradient and history), in the same order and with the same ops as the resident
        update, so the weights are identical. Clipping needs the global norm first: a first pass brings
        each gradient in to sum its squares (Caffe sums them in the same order)."""
        clip_scale = 1.0
        if float(self.param.clip_gradients) >= 0:
            total = 0.0
            for decl in self.net.learnable:
                store.acquire([decl.diff_tensor])
                total += self.ops.sumsq(decl.diff, scratch=self.net.ctx.scratch)
                store.release([decl.diff_tensor])
            clip_scale = self._clip_scale(math.sqrt(total) / self.loss_scale.scale)
        for i, decl in enumerate(self.net.learnable):
            tensors = [decl.data_tensor, decl.diff_tensor] + [hist_set[i] for hist_set in self._history]
            store.acquire(tensors)
            if i + 1 < len(self.net.learnable):  # the next parameter comes in while this one updates
                nxt = self.net.learnable[i + 1]
                store.prefetch([nxt.data_tensor, nxt.diff_tensor] + [h[i + 1] for h in self._history])
            self._update_one(i, decl, rate, clip_scale)
            if debug:
                self._debug_line(decl)
            changed = [decl.data_tensor] + [hist_set[i] for hist_set in self._history]
            store.release(tensors, changed=changed)  # the gradient is cleared before its next use
        store.settle()  # the weights and history are home before anyone reads them (tests, snapshots)

    def _update_debug_info(self) -> None:
        """Caffe's [Update] lines: mean |w| and mean |update| of every learnable blob."""
        for decl in self.net.learnable:
            self._debug_line(decl)

    def _debug_line(self, decl: Any) -> None:
        if not hasattr(self, "_owners"):
            self._owners = {id(d): (node.name, k) for node in self.net.layers_in_prototxt_order()
                            for k, d in enumerate(node.layer.params)}
        layer, k = self._owners[id(decl)]
        n = max(1, count(decl.shape))
        data, diff = (self.ops.asum(a, scratch=self.net.ctx.scratch) / n for a in (decl.data, decl.diff))
        self.log.info(f"    [Update] Layer {layer}, param {k} data: {num(data)}; diff: {num(diff)}")

    def clip_gradients(self) -> float:
        """The scale of every diff, clip / ||all diffs||_2 when that norm exceeds clip_gradients, else 1; the
        update applies it (Caffe: before iter_size)."""
        if float(self.param.clip_gradients) < 0:
            return 1.0
        total = sum(self.ops.sumsq(decl.diff, scratch=self.net.ctx.scratch) for decl in self.net.learnable)
        return self._clip_scale(math.sqrt(total) / self.loss_scale.scale)

    def _gradients_finite(self, store: Any) -> bool:
        """Whether every weight gradient of this iteration is finite (streamed ones brought in to be summed)."""
        if not store.offloaded:  # one check over them all: one read back from the device per iteration
            return self.ops.all_finite([decl.diff for decl in self.net.learnable], scratch=self.net.ctx.scratch)
        for decl in self.net.learnable:  # streamed: each brought in to be checked
            store.acquire([decl.diff_tensor])
            finite = self.ops.all_finite([decl.diff], scratch=self.net.ctx.scratch)
            store.release([decl.diff_tensor])
            if not finite:
                return False
        return True

    def _clip_scale(self, norm: float) -> float:
        """clip_gradients / norm when the global L2 norm exceeds it (logged, as Caffe does), else 1."""
        clip = float(self.param.clip_gradients)
        if clip < 0 or norm <= clip:
            return 1.0
        scale = clip / norm
        self.log.info(f"Gradient clipping: scaling down gradients (L2 norm {num(norm)} > {num(clip)}) "
                      f"by scale factor {num(scale)}")
        return scale

    # -- testing and snapshots ----------------------------------------------------------------
    def test_all(self) -> None:
        for i in range(len(self.test_nets)):
            self.test(i)

    def test(self, i: int) -> None:
        self.log.info(f"Iteration {self.iter}, Testing net (#{i})")
        passes = int(self.param.test_iter[i])
        scores, loss = evaluate(self.test_nets[i], passes, self.test_passes[i])
        self.test_passes[i] += passes
        if self.param.test_compute_loss:
            self.log.info(f"Test loss: {num(loss)}")
        shown, notes = capped_outputs(score_blobs(scores))
        for k, name, value, weight in shown:
            self.log.info(output_line("Test", k, name, value, weight))
        for note in notes:
            self.log.info(note)
        self.log.record(event="test", iter=self.iter, net=i, outputs=_named([(n, v) for _, n, v, _ in shown]),
                        **({"loss": loss} if self.param.test_compute_loss else {}))

    def snapshot(self) -> tuple[str, str]:
        return write_snapshot(self)

    def request_stop(self) -> None:
        """Finish the current iteration and return from `solve` (what Ctrl-C does), with the final
        snapshot when snapshot_after_train is on."""
        self._stop_requested = True


def _copy(net: pb.NetParameter) -> pb.NetParameter:
    out = pb.NetParameter()
    out.CopyFrom(net)
    return out


def master_type(param: pb.SolverParameter, where: str):
    """The storage type of the master weights, their gradients and the history: `solver_data_type`."""
    kind = param.solver_data_type
    if kind not in STORAGE_TYPES:
        raise UserError(f"{where}: solver_data_type: {pb.Type.Name(kind)} cannot store weights; use FLOAT, FLOAT16 "
                        f"or BFLOAT16")
    return STORAGE_TYPES[kind]


def _named(values: list[tuple[str, float]]) -> dict[str, float]:
    """Outputs keyed by blob name; a blob with several values gets `name[k]` keys."""
    counts: dict[str, int] = {}
    for name, _ in values:
        counts[name] = counts.get(name, 0) + 1
    out: dict[str, float] = {}
    seen: dict[str, int] = {}
    for name, value in values:
        if counts[name] == 1:
            out[name] = value
        else:
            out[f"{name}[{seen.get(name, 0)}]"] = value
            seen[name] = seen.get(name, 0) + 1
    return out


def memory_line(net: Net) -> str:
    """How the training net manages device memory: the mode (and what auto weighed to pick it), the pool."""
    choice = getattr(net.memory, "auto", None)
    if choice is not None:
        return f"Memory: {choice.summary()}"
    mode = net.memory.name
    types = getattr(net, "checkpoint_types", ())
    extra = f", checkpoints: {', '.join(types)}" if mode in ("offload", "recompute") and types else ""
    return f"Memory: --memory {mode}{extra}, pool {format_bytes(net.pool.capacity)}"
