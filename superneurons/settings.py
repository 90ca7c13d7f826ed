"""Every SUPERNEURONS_* environment variable, declared once: name, type, default and what it does.

Environment variables are for diagnostics and benchmarks: they switch one mechanism off to compare or to
debug, or tune a GPU kernel. Policy (fusion, gradient aliasing, the tensor cache, the allocator, parameter
streaming) lives in the solver's `memory_param` (proto/superneurons.proto, MemoryParameter); the variables
that override one of its fields say so (`overrides`), and win over it when set.

Values are read when the code uses them, not at import, so a variable set after `import superneurons`
counts; each distinct value is parsed once (`get`). docs/SETTINGS.md holds the table `markdown_table()`
prints (`python -m superneurons.settings`), and tests/test_settings.py checks that the two agree.
`memory_policy` resolves a MemoryParameter and the overrides into the `MemoryPolicy` that graph.build and
the Net follow.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb

FLAG, INT, CHOICE, TEXT = "flag", "int", "choice", "text"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # FLAG, INT, CHOICE or TEXT
    default: Any  # None: unset means "decide" (see doc)
    doc: str
    choices: tuple[str, ...] = ()
    overrides: str = ""  # the MemoryParameter field this variable overrides, if any

    def parse(self, raw: str | None) -> Any:
        """The typed value of `raw` (None or blank: the default); a bad value is a UserError naming it."""
        stripped = (raw or "").strip()
        text = stripped.lower()
        if not text:
            return self.default
        if self.kind == TEXT:
            return stripped
        if self.kind == FLAG:
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            want = "1 or 0 (also true/false, yes/no, on/off)"
        elif self.kind == INT:
            try:
                value = int(text)
            except ValueError:
                value = -1
            if value >= 0:
                return value
            want = "a whole number >= 0"
        else:
            if text in self.choices:
                return text
            want = f"one of {', '.join(self.choices)}"
        raise UserError(f"{self.name}={raw!r}: expected {want}")


_DECLARED = (
    # -- overrides of MemoryParameter's policy fields (benchmarks and tests compare with the mechanism off)
    Setting("SUPERNEURONS_FUSE", FLAG, True,
            "Run BatchNorm->Scale->ReLU chains, Eltwise SUM->ReLU and Convolution->ReLU as one layer, let a "
            "max Pooling run the backward of the ReLU it reads, and (under baseline) a ReLU before a Concat "
            "read its slice of the Concat's gradient (graph/fuse.py); 0 runs them separately.",
            overrides="fuse_layers"),
    Setting("SUPERNEURONS_DIFF_ALIAS", FLAG, True,
            "Let Split and Eltwise SUM gradients share memory (memory/aliases.py); 0 gives every gradient its own.",
            overrides="diff_alias"),
    Setting("SUPERNEURONS_CACHE", FLAG, True,
            "Offload keeps on the device what fits (the LRU Tensor Cache); 0 moves every planned checkpoint.",
            overrides="tensor_cache"),
    Setting("SUPERNEURONS_ALLOCATOR", CHOICE, "pool",
            "`pool`: one device arena carved by the heap pool; `malloc`: one backend allocation per tensor, "
            "for comparison.", choices=("pool", "malloc"), overrides="allocator"),
    Setting("SUPERNEURONS_PARAM_OFFLOAD", FLAG, None,
            "1 streams parameters, gradients and solver history from host memory layer by layer, 0 keeps them "
            "on the device; unset: stream only when they do not fit beside the activations.",
            overrides="param_offload"),
    # -- how recurrent layers unroll for a memory mode (memory.recurrent_input)
    Setting("SUPERNEURONS_RECURRENT_INPUT", CHOICE, "auto",
            "How unrolled LSTM/RNN layers transform their input x (layers/recurrent.py): `sequence`, one matrix "
            "product for all time steps (fewest layers per step, fastest); `step`, one per time step, so that "
            "offload and recompute keep only the recurrent state per step; `auto`: step under `--memory "
            "offload`/`recompute` and where `auto` finds no plan of the sequence form that fits, else sequence "
            "(docs/MEMORY.md).", choices=("auto", "sequence", "step")),
    # -- diagnostics
    Setting("SUPERNEURONS_TRANSFER_LAG", INT, 0,
            "CPU backend: each host copy completes this many transfer calls late, to exercise the asynchronous "
            "paths without a GPU."),
    Setting("SUPERNEURONS_COPY_RESERVE", INT, 0,
            "Bytes of pool a half or channels-last net plans for the copies a GPU op makes when it refuses its "
            "arguments' types or layouts (backend/cuda/copy_room.py); copies past it live outside the plan, logged "
            "once per layer and op with the bytes to set here."),
    Setting("SUPERNEURONS_MULTI_UPDATE", FLAG, True,
            "One kernel updates every parameter and one clears every gradient (solver/fused_update.py); 0 runs "
            "the per-parameter ops."),
    Setting("SUPERNEURONS_TF32", FLAG, True,
            "cuDNN may use TF32 tensor cores for float32 convolutions; 0 asks for FMA math (matches the CPU to "
            "~1e-5)."),
    Setting("SUPERNEURONS_CUDNN_FIND", FLAG, True,
            "Rank convolution engines by timing them on the real operands at their first call (graph API: the "
            "heuristics' first 8 precompiled plans; legacy API: cudnnFind*), as PyTorch's cudnn.benchmark; 0 "
            "takes cuDNN's heuristic ranking, as does SUPERNEURONS_CUDNN_DETERMINISTIC=1."),
    Setting("SUPERNEURONS_CUDNN_MEASURED", INT, 8,
            "Graph API: how many of the heuristics' precompiled plans SUPERNEURONS_CUDNN_FIND times per convolution "
            "direction (at least 1); more may find an engine the first eight lack (NHWC's 1x1 convolutions, "
            "docs/ARCHITECTURE.md) at the cost of a longer first iteration."),
    Setting("SUPERNEURONS_CUDNN_GRAPH", FLAG, True,
            "Run ungrouped convolutions through cuDNN's graph API (prebuilt plans); 0 uses the legacy calls."),
    Setting("SUPERNEURONS_CUDNN_DETERMINISTIC", FLAG, False,
            "Convolutions only through the cuDNN engines and algorithms it marks deterministic (some "
            "weight-gradient ones add partial sums in no fixed order, so two GPU runs differ by float rounding); "
            "with it a small net repeats bit for bit (tools/gpu/determinism.py). BatchNorm's float64 partial "
            "sums still add in any order, which rarely shows after rounding to float32."),
    Setting("SUPERNEURONS_FAST_LAUNCH", FLAG, True,
            "Launch numba kernels through cuLaunchKernel with recorded arguments (read at the first launch); 0 "
            "takes numba's own path every time."),
    Setting("SUPERNEURONS_CUDA_GRAPH", FLAG, True,
            "Record a training pass as two CUDA graphs (forward, backward) after two eager passes of its kind and "
            "replay it with two launches (runtime/graph_replay.py: under `baseline`, with no Python layer and no "
            "per-step hooks; the others run eagerly and say why); 0 issues every kernel from Python on every pass."),
    Setting("SUPERNEURONS_LAYOUT", CHOICE, "nchw",
            "Memory layout of 4-D activations on the GPU: `nchw` everywhere (Caffe's), `nhwc` (channels last, "
            "where cuDNN's tensor-core convolutions run without transposes) for the blobs whose producer and "
            "readers all have a channels-last path, `auto`: nhwc for the nets measured faster so (graph/layout.py: "
            "every convolution's top channels last, none grouped, no Concat, float32 or bfloat16 storage, a "
            "BatchNorm net in bfloat16 only where its training passes replay as CUDA graphs; on an H200 that is "
            "VGG16 and the ResNets), and under `--memory auto` only while every tensor stays resident (in "
            "baseline, for a net that needs replay). Users, pycaffe and caffemodels see N,C,H,W "
            "whatever this says; the CPU keeps NCHW.",
            choices=("nchw", "nhwc", "auto")),
    Setting("SUPERNEURONS_CONV_BIAS_SUM", CHOICE, "auto",
            "Convolution bias gradients: `cudnn` (cudnnConvolutionBackwardBias), `own` (the per-channel sum "
            "kernel Bias and InnerProduct use), `auto`: own on the planes where it measured faster "
            "(backend/cuda/ops/conv.py, tools/bench/conv_bias.py).", choices=("auto", "cudnn", "own")),
    Setting("SUPERNEURONS_HOST_MEMORY_MB", INT, None,
            "MiB of pinned host memory `--memory auto` lets a plan take (offloaded tensors, streamed parameters; "
            "memory/host.py); unset: 80% of this machine's RAM. A plan that may pin more is not chosen."),
    Setting("SUPERNEURONS_DP_BUCKET_MB", INT, 25,
            "Data parallelism: MiB of gradients per bucket, each bucket one all-reduce started as backward "
            "finishes its gradients (parallel/reducer.py; default measured with tools.bench.scaling "
            "--bucket-sweep); 0 reduces every gradient as a bucket of its own."),
    Setting("SUPERNEURONS_DP_NCCL_CTAS", INT, None,
            "Data parallelism on GPUs: the most thread blocks (CTAs, 1-32) one NCCL reduction kernel takes; the "
            "reductions run beside backward, so every block they hold is a multiprocessor backward waits for. "
            "Unset: NCCL's own choice, which measured fastest (4 H200s: every cap of 16 down to 2 slowed VGG16 and "
            "ResNet-50; docs/PARALLEL.md)."),
    Setting("SUPERNEURONS_DP_STREAM_PRIORITY", CHOICE, "normal",
            "Data parallelism on GPUs: the priority of the stream NCCL's reductions run on. `high`: the device's "
            "highest, so their blocks start before backward's as multiprocessors free up; `normal`: compute's, "
            "which measured as fast (4 H200s, docs/PARALLEL.md).", choices=("normal", "high")),
    Setting("SUPERNEURONS_DP_REDUCE", CHOICE, "fp32",
            "Data parallelism: the type gradients are summed across ranks in. `fp32`: the float32 gradients, in "
            "place; `backward`: where the net stores gradients in float16 or bfloat16, that type (half the bytes "
            "on the wire; each bucket scaled by 1/N and rounded into a planned half buffer, summed, widened back, "
            "docs/PARALLEL.md). `train --reduce-type` overrides it.", choices=("fp32", "backward")),
    Setting("SUPERNEURONS_CUDA_SPREAD", FLAG, True,
            "Per-channel reductions (BatchNorm, Scale, bias gradients) spread each channel over several blocks; "
            "0 uses one block per channel."),
    Setting("SUPERNEURONS_BN_ROWS", FLAG, True,
            "Fused BatchNorm sweeps long planes plainly (see SUPERNEURONS_BN_ROWS_MIN); 0 keeps the general "
            "walk everywhere."),
    Setting("SUPERNEURONS_BN_ROWS_MIN", INT, 1024,
            "Fused BatchNorm: elements per plane from which the plain-sweep kernels run (four 256-thread "
            "blocks)."),
    Setting("SUPERNEURONS_BN_MIN_BLOCK", INT, 8192,
            "Fused BatchNorm: the fewest elements one block of the partial-sum kernels takes on."),
    Setting("SUPERNEURONS_BN_CHANNEL_MIN", INT, 256,
            "Fused BatchNorm: from this many channels (and up to SUPERNEURONS_BN_CHANNEL_MAX elements per "
            "channel, on planes short of SUPERNEURONS_BN_ROWS_MIN) one block per channel runs forward and "
            "backward in one launch each; 0 never."),
    Setting("SUPERNEURONS_BN_CHANNEL_MAX", INT, 65536,
            "Fused BatchNorm: the most elements per channel (batch x plane) the one-block-per-channel kernels "
            "take."),
    # -- read by the test suite only
    Setting("SUPERNEURONS_ZOO", TEXT, None,
            "Tests: the folder holding Caffe's model zoo (`caffe/models/bvlc_alexnet/deploy.prototxt`, ...); "
            "unset, the tests that read it skip and say so."),
    # -- set by the program itself, not by users
    Setting("SUPERNEURONS_DP_ERRORS", TEXT, None,
            "Internal: the folder where the data-parallel launcher (`--gpu 0,1`) asks each rank to write its "
            "error, so the job ends with the failing rank's message."),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _DECLARED}
_parsed: dict[str, tuple[str | None, Any]] = {}  # name -> (raw value, its parse): hot paths read cheaply


def get(name: str) -> Any:
    """The current value of the declared variable `name` (its default when unset or blank)."""
    setting = SETTINGS[name]  # a KeyError here is a variable someone forgot to declare above
    raw = os.environ.get(name)
    cached = _parsed.get(name)
    if cached is not None and cached[0] == raw:
        return cached[1]
    value = setting.parse(raw)
    _parsed[name] = (raw, value)
    return value


def is_set(name: str) -> bool:
    """Whether `name` is set to a non-blank value (then it overrides the MemoryParameter field it names)."""
    SETTINGS[name]
    return bool(os.environ.get(name, "").strip())


def override(name: str, value: Any) -> Any:
    """`value` (a MemoryParameter field's), unless the environment variable `name` overrides it."""
    return get(name) if is_set(name) else value


@dataclass(frozen=True)
class MemoryPolicy:
    fuse_layers: bool = True  # graph/fuse.py runs (graph.build)
    diff_alias: bool = True  # memory/aliases.py shares gradients (Graph.diff_alias)
    tensor_cache: bool = True  # offload keeps on the device what fits
    allocator: str = "pool"  # memory/pool.ALLOCATORS
    param_offload: bool | None = None  # None: stream the parameters only when they do not fit


def memory_policy(memory_param: pb.MemoryParameter | None = None) -> MemoryPolicy:
    """The policy of `memory_param` (None: MemoryParameter's defaults), where no environment variable
    overrides a field; the variables are read now."""
    p = memory_param if memory_param is not None else pb.MemoryParameter()
    return MemoryPolicy(
        fuse_layers=override("SUPERNEURONS_FUSE", p.fuse_layers),
        diff_alias=override("SUPERNEURONS_DIFF_ALIAS", p.diff_alias),
        tensor_cache=override("SUPERNEURONS_CACHE", p.tensor_cache),
        allocator=override("SUPERNEURONS_ALLOCATOR", pb.MemoryParameter.Allocator.Name(p.allocator).lower()),
        param_offload=override("SUPERNEURONS_PARAM_OFFLOAD", p.param_offload if p.HasField("param_offload") else None),
    )


def _default_text(s: Setting) -> str:
    if s.default is None:
        return "unset"
    if s.kind == FLAG:
        return "1" if s.default else "0"
    return str(s.default)


def markdown_table() -> str:
    """The table of docs/SETTINGS.md."""
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for s in _DECLARED:
        kind = "/".join(s.choices) if s.kind == CHOICE else s.kind
        doc = s.doc + (f" Overrides `memory_param {{ {s.overrides} }}`." if s.overrides else "")
        rows.append(f"| `{s.name}` | {kind} | {_default_text(s)} | {doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
