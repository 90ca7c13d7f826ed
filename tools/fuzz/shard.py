#!/usr/bin/env python3
"""One shard of a fuzz run: cases [start, stop) of one kind, in a folder and a worker process of its own.

A shard copies the pristine corpus into its folder and runs its cases there, in order, each as the
serial fuzzer always has: case i's files from Random(f"{seed}:{kind}:{i}"), then the CLI as the shard's mode
runs it (runner.py: a child of the fork server, a fresh process, or the in-process worker).
Its own folder because cases write into it (a solver's snapshots can overwrite the corpus's
`out/lenet_iter_2.*`, which the caffemodel kinds mutate) and because LMDB knows environments by inode:
a database folder made after a deleted one can get its inode, and LMDB takes it for the deleted one's
environment if that is still open in the same process. So a shard's case folders are removed only when
its worker has stopped, with the whole shard folder.

`fuzz.py --jobs 1` runs shards in its own process (`run_shard`); `--jobs N` starts this file once per
shard (`python shard.py SPEC-JSON`), which writes one JSON line per case on stdout. SIGTERM stops it:
its worker is stopped and its folder removed; it also gets SIGTERM when the fuzzer dies.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]

from corpus import Corpus  # noqa: E402
from kinds import KINDS  # noqa: E402
from runner import make_runner  # noqa: E402

BAD = ("traceback", "signal", "hang", "midway", "leak")


@dataclass
class Shard:
    kind: str
    seed: int
    start: int  # first case
    stop: int  # one past the last
    folder: str  # the shard's own work folder (created here, removed at the end)
    timeout: float  # seconds before a case counts as a hang
    max_memory: int  # the worker's RLIMIT_DATA
    nice: int  # added to the worker's niceness
    data_workers: int | None
    keep: str | None  # copy the files of failing cases here
    keep_every: bool  # ... and of every case (a one-case replay)
    mode: str = "fork"  # how each case runs (runner.MODES)

    @property
    def name(self) -> str:
        return f"{self.kind} cases [{self.start}, {self.stop})"


def run_shard(shard: Shard, corpus: Corpus, emit: Callable[[dict], None]) -> None:
    """Run the shard's cases; `emit` gets {"case", "outcome", "rc", "seconds", "argv", "detail"} for each."""
    folder = Path(shard.folder)
    worker = None
    try:
        shutil.copytree(corpus.root, folder)
        worker = make_runner(shard.mode, REPO, shard.max_memory, shard.nice, shard.data_workers, folder / "runner")
        mine = corpus.moved(folder)
        for i in range(shard.start, shard.stop):
            rng = random.Random(f"{shard.seed}:{shard.kind}:{i}")
            case = folder / "cases" / f"{shard.kind}-{i}"
            case.mkdir(parents=True)
            argv = KINDS[shard.kind](rng, mine, case)
            result = worker.run(argv, folder, shard.timeout)
            bad = result.outcome in BAD
            if shard.keep is not None and (bad or shard.keep_every):
                shutil.copytree(case, Path(shard.keep) / case.name, dirs_exist_ok=True)
            emit({"case": i, "outcome": result.outcome, "rc": result.rc, "seconds": round(result.seconds, 3),
                  "argv": argv,
                  "detail": result.detail[-3000:] if bad else result.detail[-300:]})
    finally:
        if worker is not None:
            worker.close()
        shutil.rmtree(folder, ignore_errors=True)


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up below must finish
    raise SystemExit(128 + signum)


def main(spec: str, corpus_file: str) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the fuzzer's to handle; it stops us with SIGTERM
    # The report owns the real stdout; anything else printed (a library's warning) goes to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    shard = Shard(**json.loads(spec))
    corpus = pickle.loads(Path(corpus_file).read_bytes())
    run_shard(shard, corpus, lambda event: channel.write(json.dumps(event) + "\n"))
    return 0


def spec(shard: Shard) -> str:
    return json.dumps(asdict(shard))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
