#!/usr/bin/env python3
"""Fuzz SuperNeurons' input files: seeded mutations of real inputs, each run through the CLI.

    python tools/fuzz/fuzz.py --kind all --cases 200 --seed 1
    python tools/fuzz/fuzz.py --kind all --cases 10000 --seed 800 --jobs 16 --nice 19    # a long run
    python tools/fuzz/fuzz.py --kind lmdb --cases 1 --seed 1 --first 57 --keep /tmp/case57   # replay one case
    python tools/fuzz/fuzz.py --kind lmdb --cases 1 --seed 1 --first 57 --mode fresh   # ... in a new process

Case i of kind K under seed S is a pure function of (S, K, i), so any finding is replayed with --first i
--cases 1, and --jobs N (the cases of each kind in N contiguous shards, run at once, each in a corpus
copy and fork server of its own) reports the same outcome for every case as --jobs 1. Each case is a
process forked from a server that imported SuperNeurons once (runner.py has the modes). Outcomes: ok,
error (exit 1 with one line naming what is wrong), traceback, signal, hang, midway, leak. Exit status: 1
when any case ended in one of the last five, 2 when the fuzzer itself could not run (a shard died), 130 on
Ctrl-C. docs/ROBUSTNESS.md has the numbers of the long runs.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]

from corpus import Corpus  # noqa: E402
from kinds import KINDS  # noqa: E402
from runner import MODES, OUTCOMES, WorkerStartError, child_setup  # noqa: E402
from shard import BAD, Shard, run_shard, spec  # noqa: E402

STOP_WAIT_S = 10.0  # how long a shard process has to clean up after SIGTERM before it is killed


class FuzzerFailed(Exception):
    """The fuzzer itself could not run (its corpus was not built, a shard process died): not a finding."""


def _how(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def _last_line(log) -> str:
    log.seek(0)
    lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    return f": {lines[-1]}" if lines else ""


def _child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def build_corpus(root: Path, corpus_file: Path, nice: int) -> Corpus:
    """Build the corpus in `root` and pickle it to `corpus_file`, in a process of its own: it trains LeNet
    through the CLI, whose Ctrl-C handling ("stop after this iteration") would take the fuzzer's Ctrl-C
    and go on, and whose start-up would turn it into an error."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, str(HERE / "corpus.py"), str(root), str(corpus_file)],
                                stdout=log, stderr=log, env=_child_env(), start_new_session=True,
                                preexec_fn=child_setup(nice, signal.SIGKILL))
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if code != 0:
            raise FuzzerFailed(f"building the corpus in {root} failed ({_how(code)}){_last_line(log)}")
    return pickle.loads(corpus_file.read_bytes())


def split(first: int, cases: int, jobs: int) -> list[tuple[int, int]]:
    """[first, first + cases) as at most `jobs` contiguous, non-empty ranges of sizes differing by at most 1."""
    n = min(jobs, cases)
    bounds = [first + cases * k // n for k in range(n + 1)]
    return list(zip(bounds, bounds[1:]))


class Tally:
    """Every case's outcome, merged from the shards kind by kind; progress lines, the report and its summary."""

    def __init__(self, kinds: list[str], cases: int, first: int, seed: int, jobs: int, log, verbose: bool,
                 progress_every: float):
        self.kinds, self.cases, self.first, self.seed, self.jobs = kinds, cases, first, seed, jobs
        self.log, self.verbose, self.progress_every = log, verbose, progress_every
        self.outcomes: dict[str, list[str | None]] = {k: [None] * cases for k in kinds}
        self.codes: dict[str, list[int | None]] = {k: [None] * cases for k in kinds}  # exit statuses
        self.findings: dict[str, list[dict]] = {k: [] for k in kinds}
        self.done: Counter = Counter()
        self.began: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.run_began = time.monotonic()
        self.last_progress = self.run_began

    def start(self, kind: str) -> None:
        self.began.setdefault(kind, time.monotonic())

    def add(self, kind: str, event: dict) -> None:
        i, outcome = event["case"], event["outcome"]
        assert self.outcomes[kind][i - self.first] is None, f"{kind} case {i} reported twice"
        self.outcomes[kind][i - self.first] = outcome
        self.codes[kind][i - self.first] = event.get("rc")
        self.done[kind] += 1
        if self.done[kind] == self.cases:
            self.ended[kind] = time.monotonic()
        if self.verbose:
            self.log(f"{kind} case {i}: {outcome} ({event['seconds']:.1f} s) {event['detail'][-300:]}")
        if outcome in BAD:
            self.findings[kind].append({k: event[k] for k in ("case", "outcome", "argv", "detail")})
            self.log(f"{kind} case {i}: {outcome}: superneurons {' '.join(event['argv'])}\n{event['detail'][-1500:]}")

    def progress(self) -> None:
        """Every `progress_every` seconds, a line on stderr for each kind with cases under way."""
        now = time.monotonic()
        if not self.progress_every or now - self.last_progress < self.progress_every:
            return
        self.last_progress = now
        for kind in self.kinds:
            if kind in self.began and kind not in self.ended:
                done, took = self.done[kind], now - self.began[kind]
                rate = done / took if took > 0 else 0.0
                left = f", about {_duration((self.cases - done) / rate)} left" if rate else ""
                print(f"fuzz: {kind} {done}/{self.cases} cases, {rate:.1f} cases/s, "
                      f"{len(self.findings[kind])} failing{left}",
                      file=sys.stderr, flush=True)

    def seconds(self, kind: str) -> float:
        return round(self.ended.get(kind, time.monotonic()) - self.began.get(kind, time.monotonic()), 1)

    def report(self) -> dict:
        return {kind: {"cases": self.cases, "seed": self.seed, "first": self.first, "jobs": self.jobs,
                       "counts": {o: self.outcomes[kind].count(o) for o in OUTCOMES},
                       "seconds": self.seconds(kind), "outcomes": self.outcomes[kind], "codes": self.codes[kind],
                       "findings": sorted(self.findings[kind], key=lambda f: f["case"])}
                for kind in self.kinds}

    def summary(self) -> list[str]:
        lines = [f"{'kind':14s} {'cases':>6s} " + " ".join(f"{o:>9s}" for o in OUTCOMES) +
                 f" {'wall s':>8s} {'cases/s':>8s}"]
        total: Counter = Counter()
        for kind in self.kinds:
            counts = Counter(self.outcomes[kind])
            total.update(counts)
            took = self.seconds(kind)
            lines.append(f"{kind:14s} {self.cases:6d} " + " ".join(f"{counts[o]:9d}" for o in OUTCOMES) +
                         f" {took:8.1f} {self.cases / took if took else 0:8.1f}")
        took = time.monotonic() - self.run_began
        n = self.cases * len(self.kinds)
        lines.append(f"{'all':14s} {n:6d} " + " ".join(f"{total[o]:9d}" for o in OUTCOMES) +
                     f" {took:8.1f} {n / took if took else 0:8.1f}")
        return lines


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class ShardProcess:
    """A shard run by shard.py in a process of its own (a session of its own: Ctrl-C reaches only the
    fuzzer, which stops it), its JSON lines read as they come."""

    def __init__(self, shard: Shard, corpus_file: Path, nice: int):
        self.shard = shard
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(HERE / "shard.py"), spec(shard), str(corpus_file)],
                                     stdout=subprocess.PIPE, stderr=self.err, env=_child_env(),
                                     start_new_session=True,
                                     preexec_fn=child_setup(nice, signal.SIGTERM))
        self.pending = b""
        self.cases = 0

    def fileno(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read(self) -> list[dict] | None:
        """The cases reported since the last read (raw reads: select must see what a buffer would hide);
        None once the process has closed its output."""
        data = os.read(self.fileno(), 1 << 16)
        if not data:
            return None
        *lines, self.pending = (self.pending + data).split(b"\n")
        self.cases += len(lines)
        return [json.loads(line) for line in lines]

    def finish(self) -> None:
        """After its output closed: raises FuzzerFailed unless it ran every case and exited 0."""
        code = self.proc.wait()
        failed = code != 0 or self.cases != self.shard.stop - self.shard.start
        why = f"({_how(code)}){_last_line(self.err)}" if failed else ""
        self._close()
        if failed:
            raise FuzzerFailed(f"the shard of {self.shard.name} stopped after {self.cases} cases {why}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it stops its worker and removes its folder
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its worker dies with it (child_setup)
                self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.err.close()
        shutil.rmtree(self.shard.folder, ignore_errors=True)  # gone already unless it was killed


def run_serial(shards: list[Shard], corpus: Corpus, tally: Tally) -> None:
    for shard in shards:
        tally.start(shard.kind)

        def emit(event: dict, kind: str = shard.kind) -> None:
            tally.add(kind, event)
            tally.progress()

        run_shard(shard, corpus, emit)


def run_parallel(shards: list[Shard], corpus_file: Path, jobs: int, nice: int, tally: Tally) -> None:
    """Up to `jobs` shard processes at once, started in the order given (kind by kind)."""
    waiting = deque(shards)
    running: list[ShardProcess] = []
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                shard = waiting.popleft()
                tally.start(shard.kind)
                running.append(ShardProcess(shard, corpus_file, nice))
            ready, _, _ = select.select(running, [], [], 1.0)
            for proc in ready:
                events = proc.read()
                if events is None:
                    running.remove(proc)
                    proc.finish()
                    continue
                for event in events:
                    tally.add(proc.shard.kind, event)
            tally.progress()
    finally:
        for proc in running:
            proc.stop()


def fuzz(kinds: list[str], cases: int, seed: int, first: int = 0, timeout: float = 60.0, work: Path | None = None,
         keep: Path | None = None, max_memory: int = 2 << 30, nice: int = 0, log=print, verbose: bool = False,
         data_workers: int | None = None, jobs: int = 1, progress: float = 30.0, mode: str = "fork") -> dict:
    """Run `cases` cases of each kind in `jobs` processes; returns {kind: {"counts", "outcomes", "findings", ...}}
    and logs a summary. `progress`: seconds between progress lines on stderr (0: none)."""
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="sn-fuzz-")) if work is None else work
    shards_folder = work / "shards"
    tally = Tally(kinds, cases, first, seed, jobs, log, verbose, progress)
    try:
        shutil.rmtree(shards_folder, ignore_errors=True)  # what a killed earlier run in this folder left
        corpus_file = work / "corpus.pickle"
        corpus = build_corpus(work / "corpus", corpus_file, nice)
        # In parallel the worker inherits its shard process's niceness; in series it is set on the worker.
        shards = [Shard(kind, seed, start, stop, str(shards_folder / f"{kind}-{start}"), timeout, max_memory,
                        nice if jobs == 1 else 0, data_workers, None if keep is None else str(keep), cases == 1, mode)
                  for kind in kinds for start, stop in split(first, cases, jobs)]
        if jobs == 1:
            run_serial(shards, corpus, tally)
        else:
            run_parallel(shards, corpus_file, jobs, nice, tally)
    finally:
        shutil.rmtree(work if own_work else shards_folder, ignore_errors=True)
    for line in tally.summary():
        log(line)
    return tally.report()


def _jobs(text: str) -> int:
    if text == "auto":
        return len(os.sched_getaffinity(0))
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of processes >= 1 or 'auto'")
    return int(text)


def _interrupted(signum, frame) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", action="append", choices=["all", *KINDS],
                        help="input kind (repeat for several; default all)")
    parser.add_argument("--cases", type=int, default=40, help="cases per kind (default 40)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--first", type=int, default=0, help="index of the first case (to replay one)")
    parser.add_argument("--jobs", type=_jobs, default=1,
                        help="shards per kind run at once, each with its own worker process (default 1; "
                             "'auto': one per CPU this process may use)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--max-memory", type=int, default=2 << 30,
                        help="each worker's memory limit in bytes (default 2 GiB; --jobs N uses up to N times this)")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the worker (and shard) processes")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one, removed after)")
    parser.add_argument("--keep", type=Path, help="copy the files of failing cases (or of a single case) here")
    parser.add_argument("--data-workers", type=int, help="decode processes per data layer, as the CLI's flag "
                        "(default: the program's own choice; 1 decodes in-process, much faster per case)")
    parser.add_argument("--progress", type=float, default=30.0,
                        help="seconds between progress lines on stderr (default 30; 0: none)")
    parser.add_argument("--mode", choices=MODES, default="fork",
                        help="how each case runs: fork (default: a child of a server that imported SuperNeurons "
                             "once), fresh (a new `python -m superneurons` per case, the reference), inprocess "
                             "(one after another in one worker process)")
    parser.add_argument("--verbose", action="store_true", help="print every case's outcome")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error("--cases must be at least 1")
    kinds = list(KINDS) if not args.kind or "all" in args.kind else list(dict.fromkeys(args.kind))
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        report = fuzz(kinds, args.cases, args.seed, args.first, args.timeout, args.work, args.keep, args.max_memory,
                      args.nice, verbose=args.verbose, data_workers=args.data_workers, jobs=args.jobs,
                      progress=args.progress, mode=args.mode)
    except KeyboardInterrupt:
        print("fuzz.py: interrupted", file=sys.stderr)
        return 130
    except (FuzzerFailed, WorkerStartError) as e:
        print(f"fuzz.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGINT, previous)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if any(report[k]["counts"][o] for k in report for o in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
