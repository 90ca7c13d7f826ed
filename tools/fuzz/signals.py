#!/usr/bin/env python3
"""Trials of `superneurons train` on an LMDB net with decode worker processes, stopped or limited from outside:

    python tools/fuzz/signals.py --kind interrupt --trials 100 --seed 1 --nice 19
    python tools/fuzz/signals.py --kind interrupt --trials 30 --seed 1 --after Memory:   # aimed at worker start
    python tools/fuzz/signals.py --kind all --trials 20 --seed 1

Kinds:
- `interrupt`: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) at a random moment from
  start-up (imports, worker start) to exit, and in half the trials a second one shortly after (the race with
  the clean-up). The run must stop with a snapshot or as interrupted: exit 0, or 130 with a line ending
  ": interrupted" (a second Ctrl-C while Python exits too: not a death by SIGINT), no traceback, no
  "Exception ignored", nothing of it left in /dev/shm, no process of it left. A Ctrl-C that lands while
  CPython itself starts, before any code of the project can run, is counted apart, not as a failure.
- `kill`: SIGKILL to the whole process group at a random moment (the resource tracker dies too, so the
  run's shared memory stays); then a short run must remove what the killed one left.
- `ulimit`: the run under a random file-size limit (`ulimit -f`, 1 KiB to 4 MiB): exit 0, or 1 with one
  `superneurons train: error:` line; no traceback; nothing left in /dev/shm.

Trial i of a kind under a seed is a pure function of (seed, kind, i) except for timing. Exit status 1 when a
trial failed. docs/ROBUSTNESS.md has the numbers of the runs.
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from superneurons.data.datum import array_to_datum  # noqa: E402
from superneurons.data.lmdb_source import write_lmdb  # noqa: E402
from superneurons.data.workers import RING_PREFIX, SHM_FOLDER  # noqa: E402

KINDS = ("interrupt", "kill", "ulimit")
TIMEOUT_S = 120.0
NET = """name: "digits"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 } data_param { source: "db" batch_size: 16 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""
SOLVER = """net: "net.prototxt" base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" display: 5 max_iter: {iters}
snapshot_prefix: "out/run" solver_mode: CPU random_seed: 1
"""


def make_folder(root: Path) -> None:
    """An LMDB of 64 random 1x28x28 digits-like records, the net, and solvers of a long and a short run."""
    import numpy as np

    rng = np.random.default_rng(0)
    records = [(f"{i:08d}".encode(), array_to_datum(rng.integers(0, 256, (1, 28, 28), dtype=np.uint8),
                                                     int(i % 10)).SerializeToString()) for i in range(64)]
    write_lmdb(str(root / "db"), records)
    (root / "net.prototxt").write_text(NET)
    (root / "long.prototxt").write_text(SOLVER.format(iters=60))
    (root / "short.prototxt").write_text(SOLVER.format(iters=2) + "snapshot_after_train: false\n")


def shm_names(pid: int | None = None) -> set[str]:
    """The slot rings in /dev/shm (those made by process `pid` only, when given: other runs may be going on)."""
    prefix = RING_PREFIX if pid is None else f"{RING_PREFIX}{pid}-"
    try:
        return {n for n in os.listdir(SHM_FOLDER) if n.startswith(prefix)}
    except OSError:
        return set()


def start(root: Path, solver: str, limit: int | None = None, nice: int = 0) -> subprocess.Popen:
    def setup() -> None:
        if nice:
            os.nice(nice)
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # Its own process group, as a shell job: a signal to the group reaches the run, its fork server and
    # its decode workers, as a terminal's Ctrl-C does.
    return subprocess.Popen([sys.executable, "-m", "superneurons", "train", "--solver", solver,
                             "--data-workers", "2", "--no-progress"], cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=setup)


def group_gone(pgid: int, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return -999, err
    return proc.returncode, err


def status(code: int) -> str:
    """A run's end in words: `exit 1`, `killed by SIGINT`, or the timeout (`finish` gives -999)."""
    if code == -999:
        return f"no exit within {TIMEOUT_S:.0f} s"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def clean_stderr(err: str) -> str | None:
    """What is wrong with a run's stderr: a traceback or an exception ignored at exit (None: nothing)."""
    for bad in ("Traceback", "Exception ignored", "leaked shared_memory"):
        if bad in err:
            return f"stderr has {bad!r}: {err[-1500:]}"
    return None


# What a trial returns when the run was stopped before any code of the project could run (not a failure).
IN_CPYTHON_START_UP = "stopped while CPython itself started"


def in_cpython_start_up(code: int, err: str) -> bool:
    """Whether a Ctrl-C stopped the run while CPython initialized, before it runs any module: killed by SIGINT
    with nothing said (Python's own handler not installed yet: from `superneurons/__main__.py` on, every
    Ctrl-C gets a line), or CPython's fatal error for a failed initialization (exit 1), e.g.
    "Fatal Python error: init_sys_streams" or "init_import_site" (a KeyboardInterrupt in `site`)."""
    return (code == -signal.SIGINT and not err.strip()) or err.startswith("Fatal Python error: init_")


class StderrReader:
    """The run's stderr, read as it comes, and whether a line with `text` has come (or the stream ended)."""

    def __init__(self, proc: subprocess.Popen, text: str):
        self.proc, self.text, self.lines = proc, text, []
        self.seen = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if self.text in line:
                self.seen.set()
        self.seen.set()

    def finish(self) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=TIMEOUT_S)
            code = self.proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            code = -999
        self.thread.join()
        return code, "".join(self.lines)


def interrupt(rng: random.Random, root: Path, nice: int, after: str | None = None) -> str | None:
    """`after`: the first Ctrl-C comes 0-1 s after the run's stderr has a line with this text (a moment to aim
    at: "Memory:" is the setup's last line before the decode workers start, "Optimization" the run's end)."""
    proc = start(root, "long.prototxt", nice=nice)
    reader = None if after is None else StderrReader(proc, after)
    if reader is None:
        time.sleep(rng.choice([rng.uniform(0, 1.5), rng.uniform(0, 6)]))  # start-up, or anywhere in a run
    else:
        reader.seen.wait(TIMEOUT_S)
        time.sleep(rng.uniform(0, 1.0))
    os.killpg(proc.pid, signal.SIGINT)
    if rng.random() < 0.5:
        time.sleep(rng.uniform(0, 0.6))  # a second Ctrl-C, while the first is acted on (or during exit)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    code, err = finish(proc) if reader is None else reader.finish()
    if in_cpython_start_up(code, err):
        return IN_CPYTHON_START_UP
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("I", "W"))]
    if code not in (0, 130):
        return f"{status(code)}: {err[-1500:]}"
    problem = clean_stderr(err)
    if problem:
        return problem
    if code == 130 and not any(x.endswith(": interrupted") for x in lines):
        return f"exit 130 without 'interrupted': {err[-800:]}"
    if not group_gone(proc.pid):
        return "a process of the run outlived it"
    left = shm_names(proc.pid)
    return f"left in {SHM_FOLDER}: {sorted(left)}" if left else None


def kill(rng: random.Random, root: Path, nice: int) -> str | None:
    proc = start(root, "long.prototxt", nice=nice)
    time.sleep(rng.uniform(0.5, 6))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    group_gone(proc.pid)
    dead = shm_names(proc.pid)
    after = start(root, "short.prototxt", nice=nice)
    code, err = finish(after)
    if code != 0:
        return f"the run after a kill: exit {code}: {err[-1500:]}"
    left = dead & shm_names()
    return f"the next run left the killed run's {sorted(left)} in {SHM_FOLDER}" if left else None


def ulimit(rng: random.Random, root: Path, nice: int) -> str | None:
    shutil.rmtree(root / "out", ignore_errors=True)
    limit = int(2 ** rng.uniform(10, 22))
    proc = start(root, "short.prototxt" if rng.random() < 0.5 else "long.prototxt", limit=limit, nice=nice)
    code, err = finish(proc)
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("I", "W", "warning:"))]
    if code == 1:
        if len(lines) != 1 or not lines[0].startswith("superneurons train: error: "):
            return f"ulimit -f {limit // 1024}: exit 1 but not one error line: {err[-1500:]}"
    elif code != 0:
        return f"ulimit -f {limit // 1024}: exit {code}: {err[-1500:]}"
    problem = clean_stderr(err)
    if problem:
        return f"ulimit -f {limit // 1024}: {problem}"
    left = shm_names(proc.pid)
    return f"left in {SHM_FOLDER}: {sorted(left)}" if left else None


TRIALS = {"interrupt": interrupt, "kill": kill, "ulimit": ulimit}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", action="append", choices=["all", *KINDS])
    parser.add_argument("--trials", type=int, default=10, help="trials per kind (default 10)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nice", type=int, default=0, help="niceness of the runs")
    parser.add_argument("--after", metavar="TEXT",
                        help="interrupt: the first Ctrl-C 0-1 s after a line of the run's log with TEXT (default: "
                             "at a random moment from the start)")
    args = parser.parse_args(argv)
    kinds = list(KINDS) if not args.kind or "all" in args.kind else list(dict.fromkeys(args.kind))
    failed = 0
    with tempfile.TemporaryDirectory(prefix="sn-signals-") as folder:
        root = Path(folder)
        make_folder(root)
        for kind in kinds:
            bad, early, began = 0, 0, time.monotonic()
            for i in range(args.trials):
                extra = {"after": args.after} if kind == "interrupt" and args.after else {}
                problem = TRIALS[kind](random.Random(f"{args.seed}:{kind}:{i}"), root, args.nice, **extra)
                if problem == IN_CPYTHON_START_UP:
                    early += 1
                    print(f"{kind} trial {i}: {problem} (not a failure)", flush=True)
                elif problem:
                    bad += 1
                    print(f"{kind} trial {i}: {problem}", flush=True)
            apart = f", {early} stopped while CPython itself started" if early else ""
            print(f"{kind}: {args.trials} trials, {bad} failed{apart}, {time.monotonic() - began:.0f} s", flush=True)
            failed += bad
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
