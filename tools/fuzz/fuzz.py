#!/usr/bin/env python3
"""Fuzz SuperNeurons' input files: seeded mutations of real inputs, each run through the CLI.

    python tools/fuzz/fuzz.py --kind all --cases 200 --seed 1
    python tools/fuzz/fuzz.py --kind lmdb --cases 1 --seed 1 --first 57 --keep /tmp/case57   # replay one case

Case i of kind K under seed S is a pure function of (S, K, i), so any finding is replayed with --first i
--cases 1. Outcomes: ok, error (exit 1 with one line naming what is wrong), traceback, signal, hang; the
exit status is 1 when any case ended in one of the last three. docs/ROBUSTNESS.md has the numbers of
the long runs.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]

from corpus import build  # noqa: E402
from kinds import KINDS  # noqa: E402
from runner import OUTCOMES, Worker  # noqa: E402

BAD = ("traceback", "signal", "hang")


def fuzz(kinds: list[str], cases: int, seed: int, first: int = 0, timeout: float = 60.0, work: Path | None = None,
         keep: Path | None = None, max_memory: int = 2 << 30, nice: int = 0, log=print, verbose: bool = False,
         data_workers: int | None = None) -> dict:
    """Run `cases` cases of each kind; returns {kind: {"counts": {...}, "findings": [...]}}."""
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="sn-fuzz-")) if work is None else work
    report: dict = {}
    worker = Worker(REPO, max_memory, nice, data_workers)
    try:
        corpus = build(work, REPO)
        for kind in kinds:
            counts: Counter = Counter()
            findings = []
            start = time.monotonic()
            for i in range(first, first + cases):
                rng = random.Random(f"{seed}:{kind}:{i}")
                case = work / "cases" / f"{kind}-{i}"
                shutil.rmtree(case, ignore_errors=True)
                case.mkdir(parents=True)
                argv = KINDS[kind](rng, corpus, case)
                result = worker.run(argv, work, timeout)
                counts[result.outcome] += 1
                if verbose:
                    log(f"{kind} case {i}: {result.outcome} ({result.seconds:.1f} s) {result.detail[-300:]}")
                if result.outcome in BAD:
                    findings.append({"case": i, "outcome": result.outcome, "argv": argv,
                                     "detail": result.detail[-3000:]})
                    log(f"{kind} case {i}: {result.outcome}: superneurons {' '.join(argv)}\n{result.detail[-1500:]}")
                if keep is not None and (result.outcome in BAD or cases == 1):
                    shutil.copytree(case, keep / f"{kind}-{i}", dirs_exist_ok=True)
            # Cases are removed only now: the worker runs every case in one process, and a database folder
            # made after a deleted one can get its inode, which LMDB takes for an environment still open
            # there (the previous case's, until its Net is collected).
            shutil.rmtree(work / "cases", ignore_errors=True)
            report[kind] = {"cases": cases, "seed": seed, "first": first,
                            "counts": {o: counts.get(o, 0) for o in OUTCOMES},
                            "seconds": round(time.monotonic() - start, 1), "findings": findings}
            log(f"{kind:14s} " + "  ".join(f"{o} {counts.get(o, 0)}" for o in OUTCOMES) +
                f"  ({report[kind]['seconds']} s)")
    finally:
        worker.stop()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", action="append", choices=["all", *KINDS],
                        help="input kind (repeat for several; default all)")
    parser.add_argument("--cases", type=int, default=40, help="cases per kind (default 40)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--first", type=int, default=0, help="index of the first case (to replay one)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--max-memory", type=int, default=2 << 30, help="the worker's memory limit in bytes")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the worker process")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one, removed after)")
    parser.add_argument("--keep", type=Path, help="copy the files of failing cases (or of a single case) here")
    parser.add_argument("--data-workers", type=int, help="decode processes per data layer, as the CLI's flag "
                        "(default: the program's own choice; 1 decodes in-process, much faster per case)")
    parser.add_argument("--verbose", action="store_true", help="print every case's outcome")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    kinds = list(KINDS) if not args.kind or "all" in args.kind else args.kind
    report = fuzz(kinds, args.cases, args.seed, args.first, args.timeout, args.work, args.keep, args.max_memory,
                  args.nice, verbose=args.verbose, data_workers=args.data_workers)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if any(report[k]["counts"][o] for k in report for o in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
