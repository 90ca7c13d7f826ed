"""`superneurons plot LOG --out curves.png`: loss, test outputs and learning rate over iterations.

Reads either the JSON-lines record `train --log-json` writes or a plain text training log
(ours or Caffe's own glog output), so old Caffe logs plot too.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from superneurons.commands._options import add_command
from superneurons.errors import UserError

EXAMPLES = """examples:
  superneurons train --solver models/lenet/lenet_solver.prototxt --log train.log
  superneurons plot train.log --out curves.png
  superneurons plot train.jsonl --out curves.png     # the --log-json record works too
"""

_ITER_LOSS = re.compile(r"Iteration (\d+).*?loss = ([-+0-9.eE]+|nan|inf)")
_TESTING = re.compile(r"Iteration (\d+), Testing net")
_TEST_OUT = re.compile(r"Test net output #\d+: (\S+) = ([-+0-9.eE]+|nan|inf)")
_LR = re.compile(r"Iteration (\d+), lr = ([-+0-9.eE]+)")


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "plot", run,
                    help="plot loss, test outputs and learning rate from a training log",
                    examples=EXAMPLES)
    p.add_argument("log", help="training log (text) or JSON-lines record")
    p.add_argument("--out", required=True, help="PNG file to write")
    return p


def parse_log(path: str) -> dict[str, list[tuple[int, float]]]:
    """Series name -> [(iteration, value)]: 'loss', 'lr', and 'test/<output>' for each test output."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    test_iter = None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("{"):
            try:
                rec = json.loads(stripped)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                _add_record(series, rec)
            continue
        if m := _TESTING.search(line):
            test_iter = int(m.group(1))
        elif (m := _TEST_OUT.search(line)) and test_iter is not None:
            series[f"test/{m.group(1)}"].append((test_iter, float(m.group(2))))
        elif m := _LR.search(line):
            series["lr"].append((int(m.group(1)), float(m.group(2))))
        elif m := _ITER_LOSS.search(line):
            series["loss"].append((int(m.group(1)), float(m.group(2))))
    if not series:
        raise UserError(f"{path}: found no training lines (expected 'Iteration N ... loss = X' or JSON records)")
    return dict(series)


def _add_record(series: dict[str, list[tuple[int, float]]], rec: dict) -> None:
    """One `--log-json` record (runtime/logging.py `TrainLog.record`, written by the solver):
    {"event": "train", "iter", "loss" (smoothed), "lr", "iter_per_s", "outputs": {blob: value}} per display and
    {"event": "test", "iter", "net", "outputs", "loss" (with test_compute_loss)} per test pass.
    Test outputs of net #0 become 'test/<blob>', those of net #k 'test/<blob> (net k)'."""
    it = rec.get("iter")
    if not isinstance(it, (int, float)):
        return
    it = int(it)
    event = rec.get("event", rec.get("kind", "train"))  # "kind": what earlier records were called
    if event == "train":
        if "loss" in rec:
            series["loss"].append((it, float(rec["loss"])))
        if "lr" in rec:
            series["lr"].append((it, float(rec["lr"])))
    elif event == "test":
        net = int(rec.get("net", 0) or 0)
        suffix = f" (net {net})" if net else ""
        for k, v in (rec.get("outputs") or {}).items():
            series[f"test/{k}{suffix}"].append((it, float(v)))
        if "loss" in rec and f"test/loss{suffix}" not in {f"test/{k}{suffix}" for k in rec.get("outputs") or {}}:
            series[f"test/loss{suffix}"].append((it, float(rec["loss"])))


def run(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = parse_log(args.log)
    panels = [("loss", ["loss"]), ("test outputs", sorted(k for k in series if k.startswith("test/"))),
              ("learning rate", ["lr"] if "lr" in series else [])]
    panels = [(title, keys) for title, keys in panels if keys and all(k in series for k in keys)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for k in keys:
            xs, ys = zip(*series[k])
            ax.plot(xs, ys, label=k.removeprefix("test/"), marker="." if len(xs) < 30 else None)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(keys) > 1 or title == "test outputs":
            ax.legend()
    axes[-1, 0].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out} ({', '.join(k for _, ks in panels for k in ks)})")
    return 0
