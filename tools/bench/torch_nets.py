"""The PyTorch side of the benchmarks: the same nets as ours, in three variants and four configurations.

- plain: the model as is;
- checkpoint: torch.utils.checkpoint (non-reentrant) over each residual block / natural segment;
- offload: the training step runs under torch.autograd.graph.save_on_cpu(pin_memory=True), so every
  tensor autograd saves for backward waits in pinned host memory.

Models: `source="prototxt"` (what the speed table compares against) has `ProtoNet` turn our prototxt's
TRAIN graph (superneurons.graph.build) into an equivalent torch.nn.Module, layer by layer: Convolution
(grouped and depthwise too: MobileNet), BatchNorm (+ the Scale after it, fused as an affine BatchNorm2d;
a Scale alone is a per-channel affine), ReLU, Pooling with Caffe's rounding (global pooling too), LRN,
InnerProduct, Dropout, Concat (DenseNet's dense blocks, SqueezeNet's fire modules, Inception's modules),
Eltwise, Split, Flatten, SoftmaxWithLoss. `copy_parameters` loads our net's weights into it, so a test can
check that both compute the same forward. `source="torchvision"` takes torchvision's model of the net
(alexnet, vgg16, resnet50/101/152, densenet121, squeezenet1_0), which may differ from the prototxt (Caffe's
AlexNet has LRN and groups, torchvision's has neither); `source="auto"` is torchvision's where it has the
net, else the prototxt's (the widest/deepest benchmarks' default).

ProtoNet's checkpoint segments: walking the layers in order, a *cut* is a point where one blob alone is
still needed later (the label aside). Between two cuts lies either a single layer of a chain or a block
with branches (a residual block, an Inception module). Blocks are segments of their own; runs of chain
layers are merged into one segment that closes after each pooling layer.

Configurations (`TORCH_CONFIGS`), as a PyTorch user who cares about speed runs a model: `fp32` (eager, NCHW:
PyTorch's default), `fp32-cl` (eager, channels_last), `bf16-cl` (bfloat16 autocast, channels_last, eager),
`bf16-cl-compile` (that under torch.compile; the first step's time, which includes compiling, is reported as
`compile_s` apart from the steady state) and `fp16-cl` (float16 autocast with a GradScaler, channels_last).

Everything here imports torch lazily enough that the segmenting logic (`segments_of`) runs without it.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tools.bench import common

VARIANTS = ("plain", "checkpoint", "offload")


@dataclass(frozen=True)
class TorchConfig:
    """One way of running a model: memory layout, autocast type (None: float32) and whether torch.compile
    wraps it."""
    name: str
    label: str
    channels_last: bool
    autocast: str | None
    compiled: bool


TORCH_CONFIGS: dict[str, TorchConfig] = {c.name: c for c in (
    TorchConfig("fp32", "fp32 NCHW", False, None, False),
    TorchConfig("fp32-cl", "fp32 channels_last", True, None, False),
    TorchConfig("bf16-cl", "bf16 autocast channels_last", True, "bfloat16", False),
    TorchConfig("bf16-cl-compile", "torch.compile bf16 autocast channels_last", True, "bfloat16", True),
    TorchConfig("fp16-cl", "fp16 autocast + GradScaler channels_last", True, "float16", False),
)}
SOURCES = ("auto", "prototxt", "torchvision")
_CHAIN_CLOSERS = ("Pooling",)
_SKIP = ("Accuracy", "Silence")


# ---------------------------------------------------------------------------------------------------
# Segments (no torch needed)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Segment:
    ops: list[int]  # indices into the op list
    input: str  # the one blob it reads from before it
    output: str  # the one blob live after it
    block: bool  # True: a block with branches; False: a run of chain layers


@dataclass
class OpInfo:
    """One layer of the graph as the segmenter sees it."""

    name: str
    type: str
    bottoms: list[str]
    tops: list[str]
    inplace_ok: bool = False  # may run in place (set by segments_of)
    extra: dict = field(default_factory=dict)


def segments_of(ops: Sequence[OpInfo], data: str, logits: str) -> list[Segment]:
    """Split `ops` (data and loss layers removed) into checkpoint segments; see the module docstring."""
    n = len(ops)
    last_use: dict[str, int] = {}
    for i, op in enumerate(ops):
        for b in op.bottoms:
            last_use[b] = i
    last_use[logits] = n  # read by the loss after the last op
    live: set[str] = {data}
    cuts = [-1]  # op indices after which exactly one blob is live
    for i, op in enumerate(ops):
        live.update(op.tops)
        live = {b for b in live if last_use.get(b, -1) > i}
        if len(live) == 1:
            cuts.append(i)
    if cuts[-1] != n - 1:
        raise ValueError(f"the net does not end in a single blob feeding the loss (live at the end: {sorted(live)})")
    atoms = [list(range(a + 1, b + 1)) for a, b in zip(cuts, cuts[1:])]
    blob_after = {i: _only_live(ops, i, data, last_use) for i in cuts}
    segments: list[Segment] = []
    chain: list[int] = []

    def close_chain() -> None:
        if chain:
            segments.append(Segment(list(chain), blob_after[chain[0] - 1], blob_after[chain[-1]], False))
            chain.clear()

    for atom in atoms:
        if len(atom) > 1:
            close_chain()
            segments.append(Segment(atom, blob_after[atom[0] - 1], blob_after[atom[-1]], True))
        else:
            chain.extend(atom)
            if ops[atom[0]].type in _CHAIN_CLOSERS:
                close_chain()
    close_chain()
    _mark_inplace(ops, segments)
    return segments


def _only_live(ops: Sequence[OpInfo], i: int, data: str, last_use: dict[str, int]) -> str:
    if i < 0:
        return data
    produced = {data}
    for op in ops[: i + 1]:
        produced.update(op.tops)
    live = [b for b in produced if last_use.get(b, -1) > i]
    assert len(live) == 1, live
    return live[0]


def _mark_inplace(ops: Sequence[OpInfo], segments: Sequence[Segment]) -> None:
    """A Caffe in-place ReLU may run in place in torch only when its input was made inside the same segment
    by a layer that returns a fresh tensor (a Split's tops alias its bottom; a segment's input is saved by
    the checkpoint and must stay intact)."""
    for seg in segments:
        producer: dict[str, str] = {}
        for i in seg.ops:
            op = ops[i]
            if op.type == "ReLU" and op.tops == op.bottoms:
                op.inplace_ok = producer.get(op.bottoms[0]) not in (None, "Split", "Flatten", "Reshape")
            for t in op.tops:
                producer[t] = op.type


# ---------------------------------------------------------------------------------------------------
# Torch modules
# ---------------------------------------------------------------------------------------------------
def _torch():
    import torch

    return torch


def module_for(node: Any, next_node: Any | None, inplace: bool) -> tuple[Any, bool]:
    """(torch module for `node`, whether it also consumed `next_node`, a Scale fused into BatchNorm)."""
    torch = _torch()
    nn = torch.nn
    layer, p, kind = node.layer, node.layer.param, node.layer.param.type
    if kind == "Convolution":
        g = layer.geom
        return nn.Conv2d(layer.c, layer.weight.shape[0], g.kernel, g.stride, g.pad, g.dilation, g.group,
                         bias=layer.bias is not None), False
    if kind == "BatchNorm":
        bp = p.batch_norm_param
        fuse = (next_node is not None and next_node.layer.param.type == "Scale"
                and next_node.bottoms == node.tops and next_node.layer.param.scale_param.bias_term)
        return nn.BatchNorm2d(node.top_shapes[0][1], eps=bp.eps, momentum=1.0 - bp.moving_average_fraction,
                              affine=fuse), fuse
    if kind == "Scale":
        return ChannelAffine(node.top_shapes[0][1], p.scale_param.bias_term), False
    if kind == "ReLU":
        slope = p.relu_param.negative_slope
        return (nn.LeakyReLU(slope, inplace=inplace) if slope else nn.ReLU(inplace=inplace)), False
    if kind == "Pooling":
        g = layer.geom
        from superneurons.proto import superneurons_pb2 as pb

        ceil = p.pooling_param.round_mode == pb.PoolingParameter.CEIL
        if g.method == "max":
            return nn.MaxPool2d(g.kernel, g.stride, g.pad, ceil_mode=ceil), False
        if g.method == "ave":
            return nn.AvgPool2d(g.kernel, g.stride, g.pad, ceil_mode=ceil, count_include_pad=True), False
        raise NotImplementedError(f"{node.name}: {g.method} pooling has no PyTorch twin here")
    if kind == "LRN":
        g = layer.geom
        if not g.across:
            raise NotImplementedError(f"{node.name}: WITHIN_CHANNEL LRN has no PyTorch twin here")
        return nn.LocalResponseNorm(g.size, alpha=g.alpha, beta=g.beta, k=g.k), False
    if kind == "InnerProduct":
        if layer.transpose:
            raise NotImplementedError(f"{node.name}: transposed InnerProduct")
        return nn.Sequential(nn.Flatten(1), nn.Linear(layer.k, layer.n, bias=layer.bias_term)), False
    if kind == "Dropout":
        return nn.Dropout(p.dropout_param.dropout_ratio), False
    if kind == "Flatten":
        return nn.Flatten(1), False
    raise NotImplementedError(f"layer {node.name!r}: type {kind} has no PyTorch twin in tools/bench/torch_nets.py")


def _channel_affine_class():
    torch = _torch()

    class _ChannelAffine(torch.nn.Module):
        """Caffe's Scale over channels (axis 1), with an optional bias."""

        def __init__(self, channels: int, bias: bool):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(channels))
            self.bias = torch.nn.Parameter(torch.zeros(channels)) if bias else None

        def forward(self, x):
            shape = (1, -1) + (1,) * (x.dim() - 2)
            y = x * self.weight.view(shape)
            return y + self.bias.view(shape) if self.bias is not None else y

    return _ChannelAffine


def ChannelAffine(channels: int, bias: bool):  # noqa: N802 (a class made on first use, torch imported late)
    return _channel_affine_class()(channels, bias)


def _proto_net_class():
    torch = _torch()
    F = torch.nn.functional

    class _ProtoNet(torch.nn.Module):
        """A torch twin of our TRAIN graph; forward(x, label) returns the loss."""

        def __init__(self, graph: Any, checkpoint: bool = False):
            super().__init__()
            nodes = [n for n in graph.nodes if n.layer.param.type not in _SKIP]
            data_nodes = [n for n in nodes if n.layer.is_data]
            loss_nodes = [n for n in nodes if n.layer.param.type == "SoftmaxWithLoss"]
            if len(data_nodes) != 1 or len(loss_nodes) != 1 or len(data_nodes[0].tops) != 2:
                raise NotImplementedError(f"{graph.name}: ProtoNet wants one (data, label) layer and one "
                                          "SoftmaxWithLoss")
            self.data, self.label = data_nodes[0].tops
            self.logits_blob = loss_nodes[0].bottoms[0]
            body = [n for n in nodes if n not in data_nodes and n not in loss_nodes]
            infos = [OpInfo(n.name, n.layer.param.type, list(n.bottoms), list(n.tops)) for n in body]
            self.segments = segments_of(infos, self.data, self.logits_blob)
            self.checkpoint = checkpoint
            self.mods = torch.nn.ModuleDict()
            self.layer_names: dict[str, list[str]] = {}  # module key -> the layers it computes (BatchNorm, Scale)
            self.steps: list[tuple[str, str, list[str], list[str], Any]] = []  # (key, type, bottoms, tops, extra)
            self.expected = {}  # top -> shape without the batch, checked on the first forward
            skip = set()
            for i, node in enumerate(body):
                if i in skip:
                    continue
                kind = node.layer.param.type
                key = f"l{i}_" + "".join(c if c.isalnum() else "_" for c in node.name)
                tops = list(node.tops)
                for t, s in zip(node.tops, node.top_shapes):
                    self.expected[t] = tuple(s[1:])
                if kind in ("Split", "Concat", "Eltwise"):
                    extra = self._combine_param(node)
                    self.steps.append((key, kind, list(node.bottoms), tops, extra))
                    continue
                nxt = body[i + 1] if i + 1 < len(body) else None
                mod, fused = module_for(node, nxt, infos[i].inplace_ok)
                if fused:
                    skip.add(i + 1)
                    tops = list(nxt.tops)
                self.mods[key] = mod
                self.layer_names[key] = [node.name] + ([nxt.name] if fused else [])
                self.steps.append((key, kind, list(node.bottoms), tops, None))
            # segment k runs the steps whose layers lie in it
            step_of = {}
            pos = 0
            for i in range(len(body)):
                if i in skip:
                    continue
                step_of[i] = pos
                pos += 1
            self.seg_steps = [[step_of[i] for i in seg.ops if i in step_of] for seg in self.segments]
            self._checked = False

        @staticmethod
        def _combine_param(node: Any) -> dict:
            p = node.layer.param
            if p.type == "Concat":
                cp = p.concat_param
                return {"axis": cp.axis if cp.HasField("axis") or not cp.HasField("concat_dim") else cp.concat_dim}
            if p.type == "Eltwise":
                ep = p.eltwise_param
                return {"op": int(ep.operation), "coeff": list(ep.coeff)}
            return {}

        def _run(self, k: int, x):
            blobs = {self.segments[k].input: x}
            for s in self.seg_steps[k]:
                key, kind, bottoms, tops, extra = self.steps[s]
                ins = [blobs[b] for b in bottoms]
                if kind == "Split":
                    for t in tops:
                        blobs[t] = ins[0]
                    continue
                if kind == "Concat":
                    y = torch.cat(ins, dim=extra["axis"])
                elif kind == "Eltwise":
                    y = _eltwise(ins, extra)
                else:
                    y = self.mods[key](ins[0])
                blobs[tops[0]] = y
                if not self._checked and tuple(y.shape[1:]) != self.expected.get(tops[0], tuple(y.shape[1:])):
                    raise RuntimeError(f"ProtoNet: {key} made {tuple(y.shape[1:])} for {tops[0]!r}, our graph "
                                       f"says {self.expected[tops[0]]}")
            return blobs[self.segments[k].output]

        def logits(self, x):
            """The blob the SoftmaxWithLoss reads, as our graph shapes it."""
            from torch.utils.checkpoint import checkpoint

            for k, seg in enumerate(self.segments):
                if self.checkpoint and self.training and torch.is_grad_enabled():
                    x = checkpoint(self._run, k, x, use_reentrant=False)
                else:
                    x = self._run(k, x)
            self._checked = True
            return x

        def forward(self, x, label):
            return F.cross_entropy(self.logits(x).flatten(1), label)

    def _eltwise(ins, extra):
        op = extra["op"]
        if op == 1:  # SUM
            coeff = extra["coeff"] or [1.0] * len(ins)
            y = ins[0] * coeff[0] if coeff[0] != 1.0 else ins[0]
            for c, t in zip(coeff[1:], ins[1:]):
                y = y + (t * c if c != 1.0 else t)
            return y
        if op == 0:  # PROD
            y = ins[0]
            for t in ins[1:]:
                y = y * t
            return y
        y = ins[0]
        for t in ins[1:]:
            y = torch.maximum(y, t)
        return y

    return _ProtoNet


def learnables(model: Any) -> list[tuple[str, list[Any]]]:
    """(our layer's name, its learnable torch tensors in Caffe's blob order: weight, then bias) of a ProtoNet."""
    torch = _torch()
    out = []
    for key, names in model.layer_names.items():
        mod = model.mods[key]
        if isinstance(mod, torch.nn.Sequential):  # InnerProduct: Flatten + Linear
            mod = mod[-1]
        if isinstance(mod, torch.nn.BatchNorm2d):  # the learnables are the fused Scale's, if any
            names = names[1:]
        if names:
            out.append((names[0], [t for t in (getattr(mod, "weight", None), getattr(mod, "bias", None))
                                   if t is not None]))
    return out


def copy_parameters(model: Any, params: dict[str, Sequence[Any]]) -> int:
    """Load our layers' learnable blobs (`params`: layer name -> its blobs as arrays, Caffe's order: weight
    then bias; BatchNorm's mean/variance/factor are not learnable and are left alone) into a ProtoNet.
    Returns how many tensors were copied; a shape that differs is an error naming the layer."""
    torch = _torch()
    copied = 0
    for name, targets in learnables(model):
        if name not in params:
            continue
        blobs = list(params[name])
        if len(blobs) != len(targets):
            raise ValueError(f"layer {name!r}: {len(blobs)} blobs for {len(targets)} torch tensors")
        with torch.no_grad():
            for t, b in zip(targets, blobs):
                value = torch.as_tensor(b, dtype=t.dtype)
                if value.numel() != t.numel():
                    raise ValueError(f"layer {name!r}: blob of shape {tuple(value.shape)} for a torch tensor "
                                     f"of shape {tuple(t.shape)}")
                t.copy_(value.reshape(t.shape))
                copied += 1
    return copied


# ---------------------------------------------------------------------------------------------------
# torchvision models and their checkpointed forms
# ---------------------------------------------------------------------------------------------------
def _checkpointed_class():
    torch = _torch()

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            from torch.utils.checkpoint import checkpoint

            if not torch.is_grad_enabled():
                return self.inner(*args)
            return checkpoint(self.inner, *args, use_reentrant=False)

    return Checkpointed


def _with_loss_class():
    torch = _torch()

    class WithLoss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, label):
            return torch.nn.functional.cross_entropy(self.model(x), label)

    return WithLoss


def torchvision_model(name: str, checkpoint: bool):
    torch = _torch()
    import torchvision

    model = getattr(torchvision.models, name)()
    if checkpoint:
        ck = _checkpointed_class()
        if name.startswith("resnet"):
            for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
                for i in range(len(stage)):
                    stage[i] = ck(stage[i])
        elif name.startswith("densenet"):
            for block in model.features.children():
                if type(block).__name__ == "_DenseBlock":
                    for key in list(block.keys()):
                        block[key] = ck(block[key])
        else:  # alexnet, vgg: the feature layers up to each max pooling are a segment
            segs, cur = [], []
            for m in model.features:
                cur.append(m)
                if isinstance(m, torch.nn.MaxPool2d):
                    segs.append(ck(torch.nn.Sequential(*cur)))
                    cur = []
            if cur:
                segs.append(ck(torch.nn.Sequential(*cur)))
            model.features = torch.nn.Sequential(*segs)
    return _with_loss_class()(model)


def build(net: str, variant: str, batch: int, source: str = "auto"):
    """(model returning the loss, input shape (N, C, H, W), source used). net: a known name or 'deep:N'."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: choose from {', '.join(VARIANTS)}")
    graph = common.train_graph(net, batch)
    data = next(n for n in graph.nodes if n.layer.is_data)
    shape = tuple(int(d) for d in data.top_shapes[0])
    spec = common.NETS.get(net)
    if source not in SOURCES:
        raise ValueError(f"source {source!r}: choose from {', '.join(SOURCES)}")
    if source == "torchvision" and (spec is None or not spec.torchvision):
        raise ValueError(f"{net}: torchvision has no model of this net")
    use_tv = source == "torchvision" or (source == "auto" and spec is not None and spec.torchvision)
    if use_tv:
        return torchvision_model(spec.torchvision, variant == "checkpoint"), shape, "torchvision"
    return _proto_net_class()(graph, checkpoint=variant == "checkpoint"), shape, "prototxt"


# ---------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------
class Trainer:
    """One model, its SGD optimizer (our solver's lr, momentum, weight decay) and a training step, run in one of
    TORCH_CONFIGS."""

    def __init__(self, net: str, variant: str, batch: int, source: str = "auto", config: str = "fp32"):
        torch = _torch()
        from superneurons.io.prototxt import read_solver

        if config not in TORCH_CONFIGS:
            raise ValueError(f"config {config!r}: choose from {', '.join(TORCH_CONFIGS)}")
        self.config = TORCH_CONFIGS[config]
        spec = common.NETS["resnet50" if net.startswith("deep:") else net]
        sp = read_solver(str(common.ROOT / spec.solver))
        torch.manual_seed(0)
        self.dev = torch.device("cuda")
        model, self.shape, self.source = build(net, variant, batch, source)
        self.model = model.to(self.dev).train()
        if self.config.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=sp.base_lr or 0.01, momentum=sp.momentum,
                                   weight_decay=sp.weight_decay)
        self.forward = torch.compile(self.model) if self.config.compiled else self.model
        # float16 autocast needs loss scaling, as its users run it; bfloat16 has float32's range.
        self.scaler = torch.amp.GradScaler("cuda") if self.config.autocast == "float16" else None
        self.variant = variant
        self.x = self.y = None

    def set_batch(self, batch: int) -> None:
        torch = _torch()
        self.x = self.y = None
        x = torch.randn((batch,) + self.shape[1:], device=self.dev)
        self.x = x.to(memory_format=torch.channels_last) if self.config.channels_last else x
        self.y = torch.full((batch,), 7, dtype=torch.long, device=self.dev)

    def _loss(self):
        torch = _torch()
        if self.config.autocast is None:
            return self.forward(self.x, self.y)
        with torch.autocast("cuda", dtype=getattr(torch, self.config.autocast)):
            return self.forward(self.x, self.y)

    def step(self):
        torch = _torch()
        self.opt.zero_grad(set_to_none=True)
        if self.variant == "offload":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = self._loss()
        else:
            loss = self._loss()
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        return loss


def cap(budget: int | None) -> dict:
    """Cap PyTorch's caching allocator at `budget` bytes of this GPU (None: no cap)."""
    torch = _torch()
    total = torch.cuda.get_device_properties(0).total_memory
    frac = 1.0 if budget is None else min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(frac, 0)
    return {"fraction": frac, "device_total": total, "budget": budget}


def _clean() -> None:
    torch = _torch()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def settings(benchmark: bool, tf32: bool | None) -> dict:
    """Set cudnn.benchmark and, unless `tf32` is None (PyTorch's defaults), whether cuDNN convolutions may use
    TF32; returns the settings in force, read back from torch (matmul TF32 is left at PyTorch's default, off,
    as our cuBLAS GEMMs run in FP32)."""
    torch = _torch()
    torch.backends.cudnn.benchmark = benchmark
    if tf32 is not None:
        torch.backends.cudnn.allow_tf32 = tf32
    return {"cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32)}


def measure(net: str, variant: str, batch: int, iterations: int = 10, warmup: int = 3, budget: int | None = None,
            source: str = "auto", benchmark: bool = False, tf32: bool | None = None, config: str = "fp32") -> dict:
    """img/s of `variant` at `batch` in `config` (warm-up untimed; the first step, which compiles under
    torch.compile, is timed apart as `compile_s`); {'ok': False, 'fits': False} on OOM."""
    torch = _torch()
    in_force = settings(benchmark, tf32)
    info = cap(budget)
    try:
        tr = Trainer(net, variant, batch, source, config)
        tr.set_batch(batch)
        t0 = time.perf_counter()
        tr.step()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        timing = common.time_loop(tr.step, torch.cuda.synchronize, max(0, warmup - 1), iterations)
        loss = float(tr.step().detach())
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        return {"ok": False, "fits": False, "batch": batch, "variant": variant, "source": source, "config": config,
                "error": f"OOM: {str(e)[:200]}", **in_force}
    result = {"net": net, "variant": variant, "batch": batch, "source": tr.source, "config": config, "fits": True,
              "first_step_s": first_s, "compile_s": first_s if tr.config.compiled else None,
              "img_per_s": batch * iterations / timing["seconds"] if iterations else None,
              "max_memory_allocated": torch.cuda.max_memory_allocated(), "loss": loss,
              **in_force, **timing, **info}
    del tr
    _clean()
    return result


def fits_in_memory(steps: Callable[[], None], release: Callable[[], None]) -> bool:
    """Whether `steps` (training steps at a probed size) run to the end on the GPU without running out of
    memory; `release` then frees what they left (gradients, batches, the allocator's cache), fit or not."""
    torch = _torch()
    try:
        steps()
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        release()


def _fits(trainer_for: Callable[[int], Any], batch_of: Callable[[int], int], value: int, iterations: int) -> bool:
    made: list[Any] = []

    def steps() -> None:
        made.append(trainer_for(value))
        made[0].set_batch(batch_of(value))
        for _ in range(iterations):
            made[0].step()

    def release() -> None:
        for tr in made:
            tr.opt.zero_grad(set_to_none=True)
            tr.x = tr.y = None
        made.clear()
        _clean()

    return fits_in_memory(steps, release)


def widest(net: str, variant: str, start: int, budget: int, step: int = 8, max_probes: int = 8,
           source: str = "auto", iterations: int = 2, config: str = "fp32") -> dict:
    """The widest batch (multiple of `step`) `variant` trains under `budget` in `config`, probing around
    `start`."""
    torch = _torch()
    torch.backends.cudnn.benchmark = False  # no algorithm search with its own workspace trials
    info = cap(budget)
    probes: list[dict] = []
    holder: dict[str, Any] = {}

    def trainer(batch: int):
        # one model for all probes: only the batch changes (its momentum comes with the first update)
        if "tr" not in holder:
            holder["tr"] = Trainer(net, variant, start, source, config)
        return holder["tr"]

    def fits(batch: int) -> bool:
        t0 = time.perf_counter()
        ok = _fits(trainer, lambda b: b, batch, iterations)
        probes.append({"batch": batch, "fits": ok, "s": time.perf_counter() - t0})
        return ok

    try:
        best = common.search_edge(fits, start, step, max_probes)
    except torch.cuda.OutOfMemoryError as e:  # the model itself did not fit
        return {"ok": False, "widest": 0, "probes": probes, "error": f"OOM building the model: {str(e)[:200]}", **info}
    return {"net": net, "variant": variant, "config": config, "widest": best, "probes": probes,
            "source": holder["tr"].source if "tr" in holder else None, **info}


def deepest(variant: str, start: int, budget: int, batch: int = 16, step: int = 8, max_probes: int = 8,
            iterations: int = 2, config: str = "fp32") -> dict:
    """The largest N (multiple of `step`) for which make_resnet 6,32,N,6 trains at `batch` under `budget` in
    `config`."""
    torch = _torch()
    torch.backends.cudnn.benchmark = False
    info = cap(budget)
    probes: list[dict] = []

    def fits(n: int) -> bool:
        t0 = time.perf_counter()
        ok = _fits(lambda v: Trainer(f"deep:{v}", variant, batch, "prototxt", config), lambda v: batch, n,
                   iterations)
        probes.append({"n": n, "depth": common.deep_depth(n), "fits": ok, "s": time.perf_counter() - t0})
        return ok

    best = common.search_edge(fits, start, step, max_probes)
    return {"variant": variant, "config": config, "deepest_n": best, "depth": common.deep_depth(best) if best else None,
            "probes": probes, **info}
