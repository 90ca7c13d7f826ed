"""A recurrent net beside PyTorch's nn.LSTM on the same shapes: training speed, and the longest sequence each
trains under a memory budget (default 12G).

    python3 -m tools.bench.recurrent [--steps 64] [--streams 64] [--input 512] [--hidden 512] [--budget 12G]
                                     [--longest] [--device cuda] [--precision fp32|bf16|fp16]

The net: x (T, N, D) -> Caffe's LSTM (num_output H; unrolled into the runtime's steps) -> a Euclidean loss
against zeros (loss = sum(h^2) / 2T). PyTorch: nn.LSTM(D, H) (cuDNN's fused LSTM) on the same x with the same
loss. Both time forward + backward (no update), device synchronized, after --warmup untimed iterations.
--precision: ours stores activations and gradients in that type (as --precision of train); nn.LSTM runs under
autocast to the same type (weights float32, as ours).
--longest: ours, the planner's largest T (a multiple of --step) whose `--memory auto` plan fits the budget
(less the cuDNN workspace) with the pinned host memory it may take within --host-limit (searched from where
the planned need per step says the edge is: `guess_longest`), then trained 2 iterations there, stepping down on failure; PyTorch, the largest T
that trains with set_per_process_memory_fraction(budget / total), found by doubling and bisection in fresh
worker processes (each probe may run out of memory). Writes recurrent.json.
"""
from __future__ import annotations

import sys

from tools.bench import common


def lstm_net(steps: int, streams: int, inputs: int, hidden: int, precision: str = "fp32"):
    """The benchmark's NetParameter, its storage types set to `precision`."""
    from google.protobuf import text_format

    from superneurons.graph.precision import override_defaults
    from superneurons.proto import superneurons_pb2 as pb

    return override_defaults(text_format.Parse(f"""
        name: "lstm_{steps}"
        layer {{ name: "in" type: "Input" top: "x" top: "cont" top: "zeros"
                input_param {{ shape {{ dim: {steps} dim: {streams} dim: {inputs} }}
                              shape {{ dim: {steps} dim: {streams} }}
                              shape {{ dim: {steps} dim: {streams} dim: {hidden} }} }} }}
        layer {{ name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
                recurrent_param {{ num_output: {hidden} weight_filler {{ type: "uniform" min: -0.05 max: 0.05 }} }} }}
        layer {{ name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "zeros" top: "loss" }}""", pb.NetParameter()), precision)


def fits_plan(steps: int, streams: int, inputs: int, hidden: int, pool: int, precision: str = "fp32",
              host_limit: int = common.HOST_PINNED_LIMIT, rank: bool = True) -> str | None:
    """The mode `--memory auto` picks for T = steps in a pool of `pool` bytes with at most `host_limit` bytes of
    pinned host memory (the host store, streamed parameters), or None when nothing fits. As the Net's auto, the
    LSTM's input transform over the whole sequence first, then where nothing fits so, per step (memory.
    recurrent_input). `rank=False`, for the search of the longest T, which only asks whether something fits:
    only the step form is planned (its recompute plans keep the least), and auto's higher replay limits are not
    (a recompute plan held to a higher limit never peaks below the one held to max(l_i), which is weighed), so
    a probe plans each checkpoint set once instead of up to four times."""
    from superneurons.errors import UserError
    from superneurons.graph.build import build_graph
    from superneurons.memory import auto_recurrent_inputs
    from superneurons.proto import superneurons_pb2 as pb

    forms = auto_recurrent_inputs() if rank else auto_recurrent_inputs()[-1:]
    graph = build_graph(lstm_net(steps, streams, inputs, hidden, precision), pb.TRAIN, recurrent_input=forms[0])
    for form in forms:
        try:
            return _auto_mode(graph.in_recurrent_input(form), pool, host_limit, rank)
        except UserError:
            pass
    return None


def _auto_mode(graph, pool: int, host_limit: int, rank: bool) -> str:
    """`fits_plan` on one form of the net: the mode auto picks, or a UserError when nothing fits."""
    from superneurons.memory import checkpoint_sets
    from superneurons.memory.cost import choose
    from superneurons.memory.plan import PLAN_MODES, make_plan

    programs: list = []
    floors: dict = {}

    def plan_for(types, modes=PLAN_MODES, recompute_limit=0):
        if not rank and recompute_limit and types in floors:
            return floors[types]  # weighed as the same candidate (cost._with_limits drops the repeat)
        program = next(iter(programs), None)  # one Program for every plan of the net
        plan = make_plan(graph, train=True, checkpoint_types=types, modes=modes, recompute_limit=recompute_limit,
                         program=program)
        programs[:] = [plan.program]
        if "recompute" in modes and not recompute_limit:
            floors[types] = plan
        return plan

    return choose(pool, checkpoint_sets(graph, None), plan_for, host_limit).mode


def guess_longest(step: int, streams: int, inputs: int, hidden: int, pool: int, precision: str = "fp32") -> int:
    """Where the longest-T search starts: the T at which the smallest planned need (any mode, any checkpoint set,
    parameters resident) reaches `pool`, extrapolated from plans at 4 and 8 steps of `step` (needs grow
    linearly with T), so the search probes long sequences, the slow ones to plan, only near the edge."""
    from superneurons.graph.build import build_graph
    from superneurons.memory import checkpoint_sets, recurrent_input
    from superneurons.memory.plan import make_plan
    from superneurons.proto import superneurons_pb2 as pb

    def need(steps: int) -> int:  # the form recompute runs, which keeps the least
        graph = build_graph(lstm_net(steps, streams, inputs, hidden, precision), pb.TRAIN,
                            recurrent_input=recurrent_input("recompute"))
        plans = [make_plan(graph, train=True, checkpoint_types=types) for types in checkpoint_sets(graph, None)]
        return min(p.resident_need(m) for p in plans for m in ("liveness", "offload", "recompute"))

    a, b = 4 * step, 8 * step
    low, high = need(a), need(b)
    per_step = max(1.0, (high - low) / (b - a))
    return max(step, int(a + (pool - low) / per_step) // step * step)


def ours_task(steps: int, streams: int, inputs: int, hidden: int, device: str = "cuda", iterations: int = 10,
              warmup: int = 3, budget: int | None = None, workspace: int | None = None, precision: str = "fp32") -> dict:
    """Our forward + backward time at T = steps (memory `auto` in a pool of budget - workspace, when given)."""
    import numpy as np

    from superneurons.graph.build import build_graph
    from superneurons.proto import superneurons_pb2 as pb
    from superneurons.runtime.net import Net

    backend = common.make_backend(device, workspace)
    pool = budget - (workspace or 0) if budget else None
    net = Net(build_graph(lstm_net(steps, streams, inputs, hidden, precision), pb.TRAIN), backend, seed=1,
              memory="auto" if pool else "baseline", pool_bytes=pool)
    rng = np.random.default_rng(0)
    for blob, values in (("x", rng.standard_normal((steps, streams, inputs))), ("cont", np.ones((steps, streams))),
                         ("zeros", np.zeros((steps, streams, hidden)))):
        backend.from_host(net.data[blob].array, values.astype(net.data[blob].dtype))

    def step():
        net.clear_param_diffs()
        net.forward_backward()

    result = common.time_loop(step, backend.synchronize, warmup, iterations)
    result["mode"] = net.memory.name
    return result


def torch_task(steps: int, streams: int, inputs: int, hidden: int, iterations: int = 10, warmup: int = 3,
               budget: int | None = None, precision: str = "fp32") -> dict:
    """nn.LSTM's forward + backward time at T = steps (under set_per_process_memory_fraction when budgeted),
    under autocast to bfloat16 or float16 for those precisions."""
    import contextlib

    import torch

    if budget:
        torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory)
    lstm = torch.nn.LSTM(inputs, hidden).cuda()
    x = torch.randn(steps, streams, inputs, device="cuda")

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step():
        lstm.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=half) if half else contextlib.nullcontext():
            h, _ = lstm(x)
            loss = h.float().pow(2).sum() / (2 * steps)
        loss.backward()

    return common.time_loop(step, torch.cuda.synchronize, warmup, iterations)


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, [], iterations=10)
    ap.add_argument("--steps", type=int, default=64, help="time steps T of the speed rows (default %(default)s)")
    ap.add_argument("--streams", type=int, default=64, help="streams N (the batch; default %(default)s)")
    ap.add_argument("--input", type=int, default=512, help="input width D (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=512, help="num_output H (default %(default)s)")
    ap.add_argument("--step", type=int, default=64, help="granularity of the longest T (default %(default)s)")
    ap.add_argument("--longest", action="store_true", help="also find the longest T each trains under --budget")
    ap.add_argument("--host-limit", default=f"{common.HOST_PINNED_LIMIT >> 30}G",
                    help="pinned host memory our --longest run may use (default %(default)s: 60%% of this RAM)")
    ap.add_argument("--device", default="cuda", help="our device: cuda, cuda:N or cpu (default %(default)s)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="storage of activations and gradients; nn.LSTM under autocast to it (default %(default)s)")
    args = ap.parse_args(argv)
    shape = dict(streams=args.streams, inputs=args.input, hidden=args.hidden, precision=args.precision)
    budget, workspace = common.parse_size(args.budget), common.parse_size(args.workspace)
    host_limit = common.parse_size(args.host_limit)
    log = common.log_path(args, "recurrent")
    timing = dict(iterations=args.iterations, warmup=args.warmup)
    speed = dict(steps=args.steps, **shape, **timing)
    ours = {} if args.no_ours else common.run_worker(
        [dict(kind="recurrent_ours", device=args.device, **speed)], args.timeout, log=log)[0]
    torch = {} if args.no_torch else common.run_worker(
        [dict(kind="recurrent_torch", **speed)], args.timeout, log=log)[0]
    ms = (ours.get("ms_per_iter"), torch.get("ms_per_iter"))
    rows = [[f"T={args.steps} N={args.streams} D={args.input} H={args.hidden} {args.precision}", common.fmt(ms[0], ".2f"),
             common.fmt(ms[1], ".2f"), common.fmt(common.ratio(ms[1], ms[0]), ".2f")]]
    extra: dict = {"speed": {"ours": ours, "torch": torch}}
    tables = []
    if args.longest:
        longest = {}
        if not args.no_ours:
            predicted = common.search_edge(lambda t: fits_plan(t, **shape, pool=budget - workspace,
                                                                   host_limit=host_limit, rank=False) is not None,
                                           guess_longest(args.step, **shape, pool=budget - workspace),
                                           step=args.step, max_probes=12)
            ok = 0
            for t in (predicted, predicted - args.step, predicted - 2 * args.step):
                if t <= 0:
                    break
                r = common.run_worker([dict(kind="recurrent_ours", steps=t, device=args.device, iterations=2,
                                            warmup=1, budget=budget, workspace=workspace, **shape)],
                                      args.timeout, env=common.host_env(host_limit), log=log)[0]
                if r.get("ok"):
                    ok = t
                    break
            longest["ours"] = {"predicted": predicted, "trained": ok}
        if not args.no_torch:
            def torch_fits(t: int) -> bool:
                return bool(common.run_worker([dict(kind="recurrent_torch", steps=t, iterations=2, warmup=1,
                                                    budget=budget, **shape)], args.timeout, log=log)[0].get("ok"))

            longest["torch"] = {"trained": common.largest_fitting(torch_fits, step=args.step, start=args.steps)}
        extra["longest"] = longest
        tables.append({"title": f"longest sequence T trained under {args.budget}", "header": ["system", "T"],
                       "rows": [[k, v.get("trained")] for k, v in longest.items()]})
    args.tag = common.precision_tag(args.tag, args.precision)
    common.finish("recurrent", "LSTM training step (forward + backward), ms", args,
                  ["shape", "ours", "nn.LSTM", "nn.LSTM / ours"], rows, extra=extra, tables=tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
