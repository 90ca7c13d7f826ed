"""`superneurons memory`: the static memory plan of a net, per step and per mode, without a device."""
from __future__ import annotations

import argparse
import json

from superneurons.commands._options import add_command, add_input_options, add_precision_option, read_model
from superneurons.dtypes import FLOAT32
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.graph.layout import NCHW, NHWC, BlobLayouts, choose as choose_layouts, release as release_layouts
from superneurons.graph.precision import override_defaults
from superneurons.memory import BLOCK_CHECKPOINTS, auto_recurrent_inputs, checkpoint_sets, recurrent_input
from superneurons.memory.cost import TIE, Choice, choose, keeps_auto_layout
from superneurons.memory.offload import DEFAULT_CHECKPOINTS
from superneurons.memory.plan import PLAN_MODES, MemoryPlan, live_at, make_plan, offloaded_bytes, to_json
from superneurons.memory.pool import format_bytes, parse_size
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.graph_replay import expected as expected_replay
from superneurons.solver import fused_update

EXAMPLES = """examples:
  superneurons memory --model models/alexnet/train_val.prototxt --batch 200
  superneurons memory --model deploy.prototxt --batch 64 --json > plan.json
  superneurons memory --model M --batch 32 --gpu-memory 12G          # which mode `--memory auto` would pick
  superneurons memory --model M --batch 32 --plot steps.png --memory liveness
  superneurons memory --model train_val.prototxt --input-shape data=64,3,224,224   # no LMDB needed
  superneurons memory --model M --batch 64 --ranks 8 --gpu-memory 12G   # each of 8 GPUs: batch 64, 12 GiB
"""

def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "memory", run,
                    help="plan a net's memory per step under each memory mode (no GPU needed)",
                    examples=EXAMPLES)
    p.add_argument("--model", required=True, help="net prototxt (a deploy net is planned as if it fed a loss)")
    add_input_options(p)
    p.add_argument("--phase", choices=["TRAIN", "TEST"], default="TRAIN")
    p.add_argument("--memory", choices=list(PLAN_MODES) + ["auto", "all"], default="all",
                   help="which mode(s) to report (default: all; auto needs --gpu-memory)")
    p.add_argument("--gpu-memory", metavar="SIZE", help="pool budget (12G, 512M, bytes): say what auto picks")
    p.add_argument("--checkpoints", metavar="TYPES",
                   help="layer types whose outputs are offloaded and never recomputed, comma-separated (default: "
                        f"{','.join(DEFAULT_CHECKPOINTS)}; with --gpu-memory, auto also weighs "
                        f"{','.join(BLOCK_CHECKPOINTS)})")
    p.add_argument("--history", type=int, default=1, metavar="N",
                   help="solver history blobs per learnable parameter, in the pool with the weights "
                        "(SGD with momentum: 1, Adam: 2; default %(default)s)")
    p.add_argument("--ranks", type=int, metavar="N",
                   help="data parallel over N GPUs: --batch and --gpu-memory are per GPU; also show the gradient "
                        "buckets the reduction holds")
    add_precision_option(p)
    p.add_argument("--layout", choices=["nchw", "nhwc", "auto"],
                   help="the GPU's layout of 4-D activations to plan for, as SUPERNEURONS_LAYOUT (its value is the "
                        "default): channels last adds the KRSC filter copies and conversion rooms a GPU Net holds; "
                        "under --memory auto, auto's layout stays only where every tensor stays resident, as a Net's")
    p.add_argument("--reduce-type", dest="reduce_type", choices=["fp32", "backward"],
                   help="with --ranks: the type gradients are summed in (train --reduce-type); backward adds the "
                        "half buffer it reduces in to the pool (default: SUPERNEURONS_DP_REDUCE, else fp32)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/MEMORY.md describes its keys)")
    p.add_argument("--at-peak", action="store_true",
                   help="list the tensors on the device at each shown mode's peak step, by kind and layer")
    p.add_argument("--plot", metavar="FILE.png", help="draw bytes and live tensors per step, one line per mode")
    return p


def run(args) -> int:
    budget = parse_size(args.gpu_memory) if args.gpu_memory else None
    if args.memory == "auto" and budget is None:
        raise UserError("--memory auto needs --gpu-memory SIZE (the budget auto must fit)")
    net = override_defaults(read_model(args), args.precision)
    # Recurrent layers in the form the shown mode runs (memory.recurrent_input); every mode's: the step form,
    # which offload and recompute run.
    shown_mode = args.memory if args.memory in PLAN_MODES else "recompute"
    graph = build_graph(net, pb.Phase.Value(args.phase), source=args.model, recurrent_input=recurrent_input(shown_mode))
    # The layout a GPU Net of this graph stores (graph/layout.py): channels last declares buffers on the layers,
    # which every plan below then counts.
    # (auto weighs whether a Net's training passes would replay as CUDA graphs on the GPU, as the Net does)
    replayed = expected_replay(graph, args.memory, train=args.phase == "TRAIN", recorder=True)
    layouts = choose_layouts(graph, (NCHW, NHWC), args.layout, replayed=replayed)  # None: SUPERNEURONS_LAYOUT
    # As a Net under --memory auto (runtime/net.py): auto's channels last stays only where auto keeps every
    # tensor resident in the budget (in baseline where it rests on replay), else the Net declares itself again
    # in NCHW
    releasing = layouts.automatic and args.memory == "auto"
    try:
        plan, doc, choice = _plans(args, graph, budget)
    except UserError:
        if not releasing:
            raise
        choice = None
    if releasing and (choice is None or not keeps_auto_layout(choice, layouts)):
        release_layouts(layouts)
        doc_released = len(layouts.blobs)
        layouts = BlobLayouts()
        plan, doc, choice = _plans(args, graph, budget)
        doc["channels_last_released"] = doc_released
    doc["channels_last_blobs"] = len(layouts.blobs)
    shown = list(PLAN_MODES) if args.memory in ("all", "auto") else [args.memory]
    if args.plot:
        plot(plan, shown, args.plot)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        if layouts.any:
            print(f"GPU layout: channels last for {len(layouts.blobs)} 4-D blobs (their filter copies and conversion "
                  f"rooms included)")
        elif doc.get("channels_last_released"):
            print(f"GPU layout: NCHW (auto's channels last for {doc['channels_last_released']} blobs released: "
                  "the mode auto picks does not keep every tensor resident)")
        print(format_plan(plan, doc, shown))
        if "reduction" in doc:
            print(format_reduction(doc["reduction"]))
        if choice is not None:
            print(format_choice(choice))
            if "auto_recurrent_input" in doc:
                print(f"(recurrent layers' input transform {RECURRENT_FORMS[doc['auto_recurrent_input']]})")
        if args.at_peak:
            print(format_at_peak(plan, shown))
    return 0


def _plans(args, graph, budget: int | None) -> tuple[MemoryPlan, dict, Choice | None]:
    """The plan of every mode (the first checkpoint set), its JSON document, and with a budget auto's choice."""
    given = tuple(t.strip() for t in (args.checkpoints or "").split(",") if t.strip())
    sets = checkpoint_sets(graph, given)
    train = args.phase == "TRAIN"
    history = max(0, args.history)
    # The tables of the grouped update the default solver (SGD) runs on float32 masters (solver/fused_update.py).
    grouped = train and history > 0 and graph.precision.master == FLOAT32 and fused_update.wanted(None)
    chunk = fused_update.CHUNK if grouped else 0
    plan = make_plan(graph, train=train, checkpoint_types=sets[0], solver_history=history, update_chunk=chunk)
    doc = to_json(plan, args.batch or _batch_of(graph))
    if graph.recurrent_input is not None:
        doc["recurrent_input"] = graph.recurrent_input

    def planner(g, shown: MemoryPlan | None):
        """Plans of `g` for auto: `shown` (every mode) serves the first set; the others are planned only if auto
        needs them, all on one Program."""
        programs = [shown.program] if shown is not None else []

        def plan_for(types: tuple[str, ...], modes, recompute_limit: int = 0) -> MemoryPlan:
            if shown is not None and types == shown.checkpoint_types and not recompute_limit:
                return shown
            made = make_plan(g, train=train, checkpoint_types=types, modes=modes, solver_history=history,
                             recompute_limit=recompute_limit, update_chunk=chunk, program=next(iter(programs), None))
            programs[:] = [made.program]
            return made
        return plan_for

    choice = None
    if budget is not None:
        # As the Net's auto: the first form of the recurrent layers with a plan that fits
        forms = auto_recurrent_inputs()
        for k, form in enumerate(forms):
            g = graph.in_recurrent_input(form)
            try:
                choice = choose(budget, checkpoint_sets(g, given), planner(g, plan if g is graph else None))
            except UserError:
                if k == len(forms) - 1:
                    raise
                continue
            if g.recurrent_input is not None:
                doc["auto_recurrent_input"] = g.recurrent_input
            break
    if choice is not None:
        doc.update(budget_bytes=budget, **auto_doc(choice))
    if args.ranks is not None:
        from superneurons.parallel.reducer import bucket_plan, reduce_type

        if args.ranks < 1:
            raise UserError(f"--ranks must be at least 1, got {args.ranks}")
        doc["reduction"] = bucket_plan(graph, args.ranks, half=reduce_type(args.reduce_type, graph.precision))
    return plan, doc, choice


def format_reduction(r: dict) -> str:
    """The data-parallel line: every GPU runs this plan; the buckets the reduction holds."""
    sizes = ", ".join(_mib(n) for n in r["bucket_bytes"]) or "none"
    where = (f"summed in {r['reduce_type']} in a buffer of their own" if r["extra_pool_bytes"]
             else "in their own memory")
    return (f"\nData parallel over {r['ranks']} rank(s): each GPU runs the plan above (batch and budget are per "
            f"GPU); gradients ({format_bytes(r['gradient_bytes'])}) are averaged in {r['buckets']} bucket(s) "
            f"({sizes}) {where}: +{format_bytes(r['extra_pool_bytes'])} in the pool (NCCL's own "
            f"buffers stay outside it, in the margin the GPU pool leaves)")


def format_at_peak(plan: MemoryPlan, modes: list[str]) -> str:
    """Per mode: what is resident at its peak step, bytes per kind, then every tensor with its producer."""
    p = plan.program
    producer = {k: p.steps[ws[0]].node.name for k, ws in p.writers.items()}
    lines = []
    for m in modes:
        peak, step = plan.peak(m)
        st = p.steps[step]
        keys = live_at(plan, m, step)
        kinds: dict[str, int] = {}
        for k in keys:
            kinds[p.tensors[k].kind] = kinds.get(p.tensors[k].kind, 0) + p.tensors[k].nbytes
        lines += ["", f"{m}: {_mib(peak)} at step {step + 1} ({st.node.name} {st.phase}): "
                  + ", ".join(f"{kind} {_mib(n)}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))]
        for k in keys:
            t = p.tensors[k]
            used = " (used by this step)" if k in st.uses else ""
            lines.append(f"  {_mib(t.nbytes):>10}  {t.kind:<6}  {k}  [layer {producer.get(k, '-')}]{used}")
    return "\n".join(lines)


def _batch_of(graph) -> int | None:
    for n in graph.nodes:
        if n.layer.is_data and n.top_shapes and n.top_shapes[0]:
            return int(n.top_shapes[0][0])
    return None


RECURRENT_FORMS = {"sequence": "over the whole sequence", "step": "per time step"}


def format_plan(plan: MemoryPlan, doc: dict, modes: list[str]) -> str:
    mx = doc["max_layer"]
    stored = f", activations and gradients in {doc['precision']}" if doc["precision"] != "float32" else ""
    lines = [f"Net {doc['net']!r}, batch {doc['batch']}: {len(doc['steps'])} steps "
             f"({plan.program.n_forward} forward), checkpoints: {', '.join(plan.checkpoint_types)}{stored}",
             f"Parameters + gradients + solver history (resident, not below): {format_bytes(plan.param_bytes)}; "
             f"streamed from the host instead, each step holds only its own (recompute then peaks at "
             f"{_mib(plan.streamed_peak('recompute'))} with them)",
             f"Scratch of the ops' float64 sums (resident, counted in every step below): "
             f"{format_bytes(doc['scratch_bytes'])}",
             f"max(l_i) = {_mib(mx['bytes'])} at {mx['name']} ({mx['phase']})",
             "pool needed: the smallest --gpu-memory the mode trains in (parameters resident, or streamed where "
             "that needs less); a smaller pool is refused at setup"]
    form = doc.get("recurrent_input")
    if form is not None:
        lines.append(f"Recurrent layers planned with their input transform {RECURRENT_FORMS[form]} (layers/recurrent.py; "
                     "baseline and liveness run it over the whole sequence, offload and recompute per time step, "
                     "auto over the sequence where that fits: SUPERNEURONS_RECURRENT_INPUT)")
    lines.append("")
    rows = [("mode", "peak_m", "at step", "live tensors", "pool needed", "notes")]
    for m in modes:
        e = doc["modes"][m]
        step = plan.program.steps[e["peak_step"] - 1]
        notes = ""
        if m in ("offload", "recompute"):
            notes = f"offloads {format_bytes(offloaded_bytes(plan, m))}"
        if m == "recompute":
            notes += f", {e['extra_forward_steps']} replayed forward steps"
        pool = f"{e['pool_bytes']} B" + (" (streamed)" if e["pool_streams_params"] else "")
        rows.append((m, _mib(e["peak_bytes"]), f"{e['peak_step']} ({step.node.name} {step.phase})",
                     str(e["live_tensors_at_peak"]), pool, notes))
    lines += _table(rows)
    return "\n".join(lines)


def auto_doc(choice: Choice) -> dict:
    """The JSON keys of auto's choice: `auto` and `auto_streams_params` as before, plus the checkpoint types
    and every candidate weighed with its predicted cost (none when baseline or liveness fits)."""
    return {"auto": choice.mode, "auto_streams_params": choice.streams_params,
            "auto_recompute_limit": choice.recompute_limit,
            "auto_checkpoint_types": list(choice.checkpoint_types),
            "auto_candidates": [{"mode": e.mode, "checkpoint_types": list(e.checkpoint_types),
                                 "streams_params": e.streams_params, "recompute_limit": e.recompute_limit,
                                 "peak_bytes": e.peak_bytes,
                                 "compute_s": e.compute_s, "replay_s": e.replay_s, "replayed_steps": e.replays,
                                 "moved_bytes": e.moved_bytes, "transfer_s": e.transfer_s,
                                 "predicted_s": e.seconds} for e in choice.candidates]}


def format_choice(choice: Choice) -> str:
    """auto's line, and when it weighed candidates, their predicted cost relative to the fastest."""
    lines = ["", choice.summary()]
    if not choice.candidates:
        return "\n".join(lines)
    best = min(e.seconds for e in choice.candidates)
    rows = [("mode", "checkpoints", "replay limit", "peak", "compute", "replay", "moved", "transfer", "relative", "")]
    for e in sorted(choice.candidates, key=lambda e: e.seconds):
        limit = "" if e.mode != "recompute" else format_bytes(e.recompute_limit) if e.recompute_limit else "max(l_i)"
        rows.append((e.mode + (" (streamed)" if e.streams_params else ""), ",".join(e.checkpoint_types), limit,
                     format_bytes(e.peak_bytes), f"{e.compute_s * 1e3:.1f} ms", f"{e.replay_s * 1e3:.1f} ms",
                     format_bytes(e.moved_bytes), f"{e.transfer_s * 1e3:.1f} ms", f"{e.seconds / best:.2f}x",
                     "<- auto" if e is choice.chosen else ""))
    lines += ["candidates that fit (memory/cost.py), predicted time per iteration = max(compute + replay, transfer);",
              f"within {TIE:.0%} of the fastest is a tie, won by the Convolution checkpoints, then by offload, then by the "
              "higher replay limit:"]
    lines += _table(rows)
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def plot(plan: MemoryPlan, modes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(plan.program.steps) + 1))
    fig, (ax_b, ax_n) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for m in modes:
        t = plan.traces[m]
        ax_b.plot(steps, [b / 2**20 for b in t.bytes], label=m)
        ax_n.plot(steps, t.count, label=m)
    for ax in (ax_b, ax_n):
        ax.axvline(plan.program.n_forward + 0.5, color="grey", linewidth=0.8)
    ax_b.axhline(plan.max_layer[1] / 2**20, color="grey", linestyle="--", linewidth=0.8, label="max(l_i)")
    ax_b.set_ylabel("live MiB")
    ax_n.set_ylabel("live tensors")
    ax_n.set_xlabel("step (forward | backward)")
    ax_b.set_title(f"{plan.program.graph.name}: memory per step")
    ax_b.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise UserError(f"--plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
