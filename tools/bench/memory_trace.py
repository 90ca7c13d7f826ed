"""Memory per step (paper Fig. 10): AlexNet at batch 200, the plan of every mode and the pool's measured
bytes per step beside it.

    python3 -m tools.bench.memory_trace [--nets alexnet] [--batches 200] [--device cuda|cpu] [--plan-only]

The plan part needs no device: it is `superneurons memory --model models/alexnet/alexnet_dummy.prototxt
--batch 200 --plot FILE` (written to <out>/memory_plan_<net>_<batch>.png). The measured part builds our Net
under liveness, offload and recompute in a worker, each mode with a pool of its planned peak plus the
parameters (+10 %, still below the next mode's need, so offload's cache must really evict), trains two iterations and reads the manager's
per-step trace of the second; <out>/memory_trace_<net>_<batch>.png draws it over the plan.
Writes memory_trace.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tools.bench import common

MODES = ("liveness", "offload", "recompute")


def plan_picture(net: str, batch: int, out: Path) -> tuple[Path, dict]:
    """The same picture and numbers as `superneurons memory --plot` (its own functions)."""
    from superneurons.commands.memory import plot
    from superneurons.memory.plan import PLAN_MODES, make_plan

    plan = make_plan(common.train_graph(net, batch), train=True)
    path = out / f"memory_plan_{net}_{batch}.png"
    plot(plan, list(PLAN_MODES), str(path))
    s, lmax = plan.max_layer
    peaks = {m: plan.peak(m)[0] for m in PLAN_MODES}
    return path, {"peaks": peaks, "max_layer": lmax, "max_layer_step": plan.program.steps[s].node.name,
                  "param_bytes": plan.param_bytes, "n_forward": plan.program.n_forward}


def measured_picture(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for k, (mode, m) in enumerate(result["modes"].items()):
        color = f"C{k + 1}"
        steps = range(1, len(m["planned"]) + 1)
        ax.plot(steps, [b / common.MiB for b in m["planned"]], color=color, label=f"{mode} plan")
        got = m.get("measured", [])
        ax.plot(range(1, len(got) + 1), [b / common.MiB for b in got], "o", color=color,
                markersize=3, label=f"{mode} measured")
    ax.set_xlabel("step (forward, then backward)")
    ax.set_ylabel("live MiB in the pool")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, ("alexnet",), iterations=2)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu, for the measured trace")
    ap.add_argument("--plan-only", action="store_true", help="only the plan picture (no worker, no device)")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, raw = [], {}
    for net, spec, b in common.net_batches(args, [200]):
        picture, plan = plan_picture(net, b, out)
        print(f"plan picture: {picture}", flush=True)
        measured: dict = {}
        if not args.plan_only and not args.no_ours:
            measured = common.run_worker([dict(kind="memory_trace", net=net, batch=b, device=args.device,
                                               modes=[m for m in args.modes.split(",") if m])],
                                         args.timeout, log=common.log_path(args, "memory_trace"))[0]
            if any(m.get("measured") for m in measured.get("modes", {}).values()):
                trace_png = out / f"memory_trace_{net}_{b}.png"
                measured_picture(measured, trace_png, f"{spec.label} batch {b}: pool bytes per step")
                print(f"measured picture: {trace_png}", flush=True)
        raw[f"{net}@{b}"] = {"plan": plan, "measured": measured, "plan_png": picture.name}
        for mode in ("baseline",) + MODES:
            m = measured.get("modes", {}).get(mode, {})
            peak_m = max(m["measured"]) if m.get("measured") else None
            rows.append([spec.label, b, mode, round(plan["peaks"][mode] / common.MiB, 1),
                         None if peak_m is None else round(peak_m / common.MiB, 1),
                         None if m.get("max_abs_diff") is None else round(m["max_abs_diff"] / common.MiB, 2),
                         m.get("equal"),
                         str(m.get("error") or ("" if m or measured.get("ok", True) or mode == "baseline"
                                                else measured.get("error")))[:80] or None])
    header = ["net", "batch", "mode", "planned peak MiB", "measured peak MiB", "max |measured - plan| MiB",
              "equal every step", "note"]
    common.finish("memory_trace", "Memory per step, plan and measured pool trace (Fig. 10)", args, header, rows,
                  extra={"raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
