"""Snapshots: PREFIX_iter_N.caffemodel + PREFIX_iter_N.solverstate (+ .solverstate.extra), and resuming from them.

Write order makes a crash at any point harmless: the model first, then the sidecar, then the
solverstate, each written whole-or-nothing (temporary file + rename). A .solverstate therefore
always points at a complete model, and a solverstate that cannot be written takes its model and
sidecar with it. Temporary files are hidden and named after their target and writer's process
(`.x_iter_4.caffemodel.tmp-PID-...`); those of a killed run are removed when training next starts. `snapshot_format: HDF5` writes Caffe's .caffemodel.h5 /
.solverstate.h5 layout instead (needs h5py).

The .solverstate is Caffe's SolverState (iter, learned_net, history, current_step) so Caffe can
resume from it too. What Caffe does not save but an exact resume needs goes into the sidecar, a
small JSON file: the random seed actually used (random_seed -1 picks one from the clock), the
forward-pass counters of the test nets, and the state of every layer that offers
`state() -> JSON-able` / `restore(state)` (the LMDB Data layer's cursor, for instance). Layers
without it (DummyData) derive their data from (seed, iteration) and need nothing.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import numpy as np

from superneurons.errors import UserError
from superneurons.io.caffemodel import (HDF5_ERRORS, array_to_blob, blob_shape, blob_to_array, is_hdf5,
                                        load_weights, require_h5py, save_weights, write_hdf5_atomic)
from superneurons.io.prototxt import read_binary, remove_stale_temps, write_atomic, write_binary
from superneurons.proto import superneurons_pb2 as pb

if TYPE_CHECKING:
    from superneurons.runtime.net import Net
    from superneurons.solver.lr_policy import LrPolicy
    from superneurons.solver.updates import UpdateRule


class Solver(Protocol):
    """What a snapshot reads and restores of a solver (`solver.Solver`, which imports this module)."""

    param: pb.SolverParameter
    prefix: str
    iter: int
    seed: int
    test_passes: list[int]
    net: Net
    log: Any
    lr_policy: LrPolicy
    rule: UpdateRule

    def all_nets(self) -> list[tuple[str, Net]]: ...

    def history_blobs(self) -> list[Any]: ...

    def set_seed(self, seed: int) -> None: ...

EXTRA_SUFFIX = ".extra"
EXTRA_VERSION = 1


def resolve_prefix(param: pb.SolverParameter, solver_path: str) -> str:
    """Caffe's rule: no prefix -> the solver file's name without extension; a folder -> folder/solver-name."""
    stem = os.path.splitext(os.path.basename(solver_path))[0] if solver_path else "snapshot"
    prefix = param.snapshot_prefix
    if not prefix:
        return os.path.splitext(solver_path)[0] if solver_path else stem
    if prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
        return os.path.join(prefix, stem)
    return prefix


def snapshot_paths(prefix: str, iteration: int, hdf5: bool = False) -> tuple[str, str]:
    base = f"{prefix}_iter_{iteration}"
    ext = ".h5" if hdf5 else ""
    return base + ".caffemodel" + ext, base + ".solverstate" + ext


def _stateful_layers(solver: "Solver") -> Iterable[tuple[str, Any]]:
    """(key, layer) for every layer of every net that can save and restore its own state."""
    for tag, net in solver.all_nets():
        for node in net.layers_in_prototxt_order():
            layer = node.layer
            if callable(getattr(layer, "state", None)) and callable(getattr(layer, "restore", None)):
                yield f"{tag}/{node.name}", layer


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    raise TypeError(f"layer state value {obj!r} is not JSON-serializable")


def write_snapshot(solver: "Solver") -> tuple[str, str]:
    """Write the model, the sidecar and the solver state for the solver's current iteration."""
    hdf5 = solver.param.snapshot_format == pb.SolverParameter.HDF5
    model_path, state_path = snapshot_paths(solver.prefix, solver.iter, hdf5)
    solver.log.info(f"Snapshotting to {'HDF5' if hdf5 else 'binary proto'} file {model_path}")
    save_weights(solver.net, model_path)
    extra = {
        "version": EXTRA_VERSION,
        "seed": solver.seed,
        "ranks": solver.net.ctx.ranks,  # data parallelism: the resume must run as many (superneurons/parallel)
        "test_passes": solver.test_passes,
        "layers": {key: layer.state() for key, layer in _stateful_layers(solver)},
        "loss_scale": solver.loss_scale.state(),  # adaptive scaling goes on from where it was
    }
    state = pb.SolverState(iter=solver.iter, learned_net=model_path, current_step=solver.lr_policy.current_step)
    for hist in solver.history_blobs():
        array_to_blob(solver.net.backend.to_host(hist), state.history.add())  # streamed: the host home
    solver.log.info(f"Snapshotting solver state to {'HDF5' if hdf5 else 'binary proto'} file {state_path}")
    try:
        write_atomic(state_path + EXTRA_SUFFIX, json.dumps(extra, default=_json_default).encode())
        if hdf5:
            write_hdf5_atomic(state_path, lambda f: _state_to_hdf5(state, f))
        else:
            write_binary(state_path, state)
    except BaseException as e:  # (Ctrl-C included) no model without its state: a half snapshot is no snapshot
        for path in (model_path, state_path + EXTRA_SUFFIX):
            if os.path.exists(path):
                os.unlink(path)
        if isinstance(e, OSError):
            raise UserError(f"{state_path}: cannot write the solver state ({e.strerror or e})") from None
        raise
    return model_path, state_path


def remove_leftovers(solver: "Solver") -> list[str]:
    """Temporary snapshot files that a killed run left beside the snapshots (io.prototxt.open_temp_beside
    names them after their target and their writer's process id): removed when training starts."""
    folder, base = os.path.split(solver.prefix)
    return remove_stale_temps(folder, base + "_iter_")


def _find_learned_net(learned: str, state_path: str) -> str:
    """Caffe stores the model path as written (relative to the training's working folder)."""
    if not learned.strip() or os.path.isdir(learned):
        raise UserError(f"{state_path}: its learned_net {learned!r} is {'empty' if not learned.strip() else 'a folder'}"
                        ", not a .caffemodel")
    if os.path.exists(learned):
        return learned
    beside = os.path.join(os.path.dirname(state_path), os.path.basename(learned))
    if os.path.exists(beside) and not os.path.isdir(beside):
        return beside
    raise UserError(f"{state_path}: its model {learned!r} does not exist (looked in the working folder and "
                    f"beside the solverstate)")


def restore_snapshot(solver: "Solver", state_path: str) -> None:
    """Load weights, history, iteration and the sidecar's extra state into `solver`."""
    state = _read_hdf5_state(state_path) if is_hdf5(state_path) else read_binary(state_path, pb.SolverState())
    for field in ("iter", "current_step"):
        if getattr(state, field) < 0:
            raise UserError(f"{state_path}: field {field} is {getattr(state, field)}; it must be >= 0")
    solver.iter = int(state.iter)
    if state.HasField("learned_net"):
        model = _find_learned_net(_text_field(state.learned_net, "learned_net", state_path), state_path)
        try:
            load_weights(solver.net, model)
        except UserError as e:  # the model file's own error, and where its name came from
            raise UserError(f"{e} (the model named by learned_net in {state_path})") from None
    solver.lr_policy.current_step = int(state.current_step)
    hists = solver.history_blobs()
    if len(state.history) != len(hists):
        raise UserError(f"{state_path}: {len(state.history)} history blobs, but a {solver.rule.name} solver for "
                        f"this net keeps {len(hists)}; was it written by another solver type or net?")
    for k, (blob, hist) in enumerate(zip(state.history, hists)):
        if blob_shape(blob) != tuple(hist.shape):
            raise UserError(f"{state_path}: history blob {k} has shape {blob_shape(blob)}, the parameter has "
                            f"{tuple(hist.shape)}")
        solver.net.backend.from_host(hist, blob_to_array(blob, f"{state_path}: history blob {k}"))
    _restore_extra(solver, state_path + EXTRA_SUFFIX)


def _text_field(value: str | bytes, field: str, path: str) -> str:
    """Caffe's proto2 strings are bytes on the wire: one that is not UTF-8 arrives here as bytes."""
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: field {field} is not UTF-8 text (byte 0x{value[e.start]:02x} at offset "
                        f"{e.start} of the path)") from None


def _state_to_hdf5(state: pb.SolverState, f: Any) -> None:
    """Caffe's SnapshotSolverStateToHDF5 layout: iter, learned_net, current_step, /history/<k>."""
    f.create_dataset("iter", data=np.array([state.iter], dtype=np.int32))
    f.create_dataset("learned_net", data=np.bytes_(state.learned_net.encode("utf-8")))  # a path: any Unicode
    f.create_dataset("current_step", data=np.array([state.current_step], dtype=np.int32))
    history = f.create_group("history")
    for k, blob in enumerate(state.history):
        history.create_dataset(str(k), data=blob_to_array(blob, f"history {k}"))


def _read_hdf5_state(path: str) -> pb.SolverState:
    h5py = require_h5py()
    state = pb.SolverState()
    try:
        with h5py.File(path, "r") as f:
            state.iter = int(np.asarray(f["iter"]).ravel()[0])
            learned = np.asarray(f["learned_net"]).item()
            state.learned_net = _text_field(learned, "learned_net", path) if isinstance(learned, bytes) \
                else str(learned)
            if "current_step" in f:
                state.current_step = int(np.asarray(f["current_step"]).ravel()[0])
            history = f["history"]
            for k in range(len(history)):
                array_to_blob(np.asarray(history[str(k)], dtype=np.float32), state.history.add())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except HDF5_ERRORS as e:
        raise UserError(f"{path}: not a Caffe HDF5 solver state ({e})") from None
    return state


def _restore_extra(solver: "Solver", path: str) -> None:
    if not os.path.exists(path):
        if any(True for _ in _stateful_layers(solver)):
            solver.log.info(f"No {os.path.basename(path)} beside the solver state: data layers start from the "
                            "beginning (the run will not repeat an uninterrupted one exactly)")
        return
    extra = read_extra(path)
    ranks, now = extra.get("ranks", 1), solver.net.ctx.ranks
    if ranks != now:
        raise UserError(f"{path}: this snapshot was taken with {ranks} rank(s) (GPUs or processes) and this run "
                        f"has {now}; resume it with {ranks}, or start from its weights with --weights")
    solver.set_seed(extra.get("seed", solver.seed))
    passes = extra.get("test_passes", [])
    for i in range(min(len(passes), len(solver.test_passes))):
        solver.test_passes[i] = passes[i]
    if "loss_scale" in extra:
        solver.loss_scale.restore(extra["loss_scale"], path)
    saved = extra.get("layers", {})
    for key, layer in _stateful_layers(solver):
        if key in saved:
            try:
                layer.restore(saved[key])  # each layer checks its own state and names itself when it is wrong
            except UserError as e:
                raise UserError(f"{path}: {e}") from None


def _is_count(value: Any, limit: int = 1 << 63) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def read_extra(path: str) -> dict[str, Any]:
    """The sidecar's JSON, checked field by field: a damaged or hand-edited file is one line naming the field."""
    try:
        with open(path, encoding="utf-8") as f:
            extra = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UserError(f"{path}: unreadable snapshot sidecar ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(extra, dict):
        raise UserError(f"{path}: the snapshot sidecar must be a JSON object, got {type(extra).__name__}")
    version = extra.get("version", EXTRA_VERSION)
    if version != EXTRA_VERSION:
        raise UserError(f"{path}: field version is {version!r}; this SuperNeurons reads version {EXTRA_VERSION}")
    ranks = extra.get("ranks", 1)
    if not _is_count(ranks) or ranks < 1:
        raise UserError(f"{path}: field ranks is {ranks!r}; expected a positive whole number")
    if "seed" in extra and not _is_count(extra["seed"]):
        raise UserError(f"{path}: field seed is {extra['seed']!r}; expected an integer in [0, 2^63)")
    passes = extra.get("test_passes", [])
    if not isinstance(passes, list) or not all(_is_count(p) for p in passes):
        raise UserError(f"{path}: field test_passes is {str(passes)[:80]}; expected a list of integers >= 0")
    if "loss_scale" in extra and not isinstance(extra["loss_scale"], dict):  # LossScale.restore checks its fields
        raise UserError(f"{path}: field loss_scale is {str(extra['loss_scale'])[:80]}; expected an object with the "
                        f"scale and its count of clean iterations")
    layers = extra.get("layers", {})
    if not isinstance(layers, dict):
        raise UserError(f"{path}: field layers is {str(layers)[:80]}; expected an object of layer states")
    return extra
