"""PyTorch's side of tools.bench.precision_loss: the run a precision of ours is measured by, in PyTorch, so that
a half type's effect on the end point can be read off PyTorch's own runs beside ours.

Everything but the framework is the same: the net (tools/bench/torch_nets.py builds it from the same
prototxt), the initial weights (copied from our Net set up at the same random_seed), the batches in the same
order (the HDF5 files the HDF5Data layer reads, in its order), the schedule (Caffe's momentum SGD, each
parameter's lr_mult and decay_mult from the prototxt, the "poly" rate), and the held-out pass (every held-out
image once, BatchNorm on the batch's statistics, as our TEST net runs it). `torch-fp32` trains in float32,
`torch-bf16` under bfloat16 autocast, `torch-fp16` under float16 autocast with dynamic loss scaling as
GradScaler does it (from 65536, halved on an overflow whose step is skipped, doubled after 2000 clean steps).
cuDNN may use TF32 in convolutions on both sides, as ours does by default.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tools.bench import common, torch_nets

AUTOCAST = {"torch-fp32": None, "torch-bf16": "bfloat16", "torch-fp16": "float16"}
SCALE_START, SCALE_GROWTH_INTERVAL = 65536.0, 2000  # GradScaler's defaults


class LossScale:
    """Dynamic loss scaling as GradScaler does it: `step(finite)` after each backward says whether to apply the
    update (not where a gradient overflowed: the scale halves), and doubles the scale after `growth_interval`
    clean steps in a row. Scale 1, never changing, where `dynamic` is off (float32, bfloat16)."""

    def __init__(self, dynamic: bool, start: float = SCALE_START, growth_interval: int = SCALE_GROWTH_INTERVAL):
        self.dynamic = dynamic
        self.scale = start if dynamic else 1.0
        self.growth_interval = growth_interval
        self.clean = 0

    def step(self, finite: bool) -> bool:
        if not self.dynamic:
            return True
        if not finite:
            self.scale, self.clean = self.scale / 2, 0
            return False
        self.clean += 1
        if self.clean == self.growth_interval:
            self.scale, self.clean = self.scale * 2, 0
        return True


def batches(listing: Path, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(images as float32, labels as int64) of the HDF5 files `listing` names, in order, `batch` at a time."""
    import h5py

    for name in listing.read_text().split():
        with h5py.File(name, "r") as f:
            data, labels = f["data"][()], f["label"][()]
        for start in range(0, len(data), batch):
            yield data[start:start + batch].astype(np.float32), labels[start:start + batch].astype(np.int64)


def initial_weights(param: Any, device: str) -> dict[str, list[np.ndarray]]:
    """Our Net's learnable blobs as set up from solver `param` (its random_seed) on `device`, by layer."""
    from superneurons.pycaffe.net import Net as PyNet
    from superneurons.solver.solver import Solver

    backend = common.make_backend(device, None)
    solver = Solver(param, "precision_loss", backend=backend, memory="baseline", precision="fp32")
    view = PyNet._wrap(solver.net, backend)
    weights = {name: [np.array(b.data, dtype=np.float32, copy=True) for b in blobs]
               for name, blobs in view.params.items()}
    del solver, view
    common._release_device()
    return weights


def multiplied(model: Any, graph: Any) -> list[tuple[Any, float, float]]:
    """(tensor, lr_mult, decay_mult) of every learnable tensor of the twin, from its layer's ParamSpecs."""
    layers = {n.name: n.layer.param for n in graph.nodes}
    out = []
    for name, targets in torch_nets.learnables(model):
        specs = layers[name].param
        for i, t in enumerate(targets):
            spec = specs[i] if i < len(specs) else None
            out.append((t, spec.lr_mult if spec is not None else 1.0, spec.decay_mult if spec is not None else 1.0))
    return out


def train_one(config: str, seed: int, param: Any, data: tuple[Path, Path], batch: int, iterations: int,
              tested: int, device: str) -> dict:
    """One PyTorch configuration and seed, as precision_loss.train_one runs ours: every iteration's training
    loss, then the held-out pass's loss and accuracy."""
    torch = torch_nets._torch()
    from superneurons.graph.build import build_graph
    from superneurons.proto import superneurons_pb2 as pb

    cast = AUTOCAST[config]
    dev = torch.device("cuda" if device.startswith("cuda") else "cpu")
    weights = initial_weights(param, device)
    graph = build_graph(param.train_net_param, pb.TRAIN)
    model = torch_nets._proto_net_class()(graph).to(dev).train()
    torch_nets.copy_parameters(model, weights)
    tensors = multiplied(model, graph)
    history = [torch.zeros_like(t) for t, _, _ in tensors]
    scaler = LossScale(dynamic=cast == "float16")

    def loss_of(x: Any, y: Any) -> Any:
        if cast is None:
            return model(x, y)
        with torch.autocast(dev.type, dtype=getattr(torch, cast)):
            return model(x, y)

    losses: list[float] = []
    start = time.perf_counter()
    for it, (x, y) in zip(range(iterations), batches(data[0], batch)):
        rate = param.base_lr * (1.0 - it / param.max_iter) ** param.power
        for t, _, _ in tensors:
            t.grad = None
        loss = loss_of(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev))
        scale = scaler.scale
        (loss * scale).backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            grads = [t.grad / scale for t, _, _ in tensors]
            if not scaler.step(not scaler.dynamic or all(bool(torch.isfinite(g).all()) for g in grads)):
                continue  # an overflow: the step is skipped
            for (t, lr_mult, decay_mult), g, v in zip(tensors, grads, history):
                # Caffe's SGD: v = momentum v + rate lr_mult (g + decay decay_mult w); w -= v
                v.mul_(param.momentum).add_(g + param.weight_decay * decay_mult * t, alpha=rate * lr_mult)
                t.sub_(v)
    train_s = time.perf_counter() - start
    total, right, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in batches(data[1], batch):
            if seen >= tested:
                break
            xt, yt = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
            if cast is None:
                logits = model.logits(xt).flatten(1)
            else:
                with torch.autocast(dev.type, dtype=getattr(torch, cast)):
                    logits = model.logits(xt).flatten(1)
            total += float(torch.nn.functional.cross_entropy(logits.float(), yt)) * len(y)
            right += int((logits.argmax(1) == yt).sum())
            seen += len(y)
    return {"precision": config, "seed": seed, "losses": losses, "final_loss": total / seen,
            "accuracy": right / seen, "train_seconds": train_s, "seconds": time.perf_counter() - start}
