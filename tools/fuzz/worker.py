"""The fuzzer's child process: runs `superneurons` commands in-process, one JSON line in, one JSON line out.

Importing SuperNeurons once and running many cases in it is ~50x faster than a fresh interpreter per
case; the parent still sees deaths by signal (this process exits with -N) and hangs (no answer within
the case's time limit), and restarts it. Memory is capped (`--max-memory`) so that a net sized to the
whole machine is refused by the program's own size check, not slowly paged in.

    {"argv": ["test", "--model", ...], "cwd": "/tmp/case"}  ->  {"rc": 1, "err": "...", "exc": null}
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import os
import resource
import signal
import sys
import traceback


# The commands that build nets with data layers take --data-workers; the worker adds the one it was given.
DATA_WORKER_COMMANDS = ("train", "test", "time")


def run_case(argv: list[str], cwd: str, data_workers: int | None = None) -> dict:
    from superneurons.cli import main

    if data_workers is not None and argv and argv[0] in DATA_WORKER_COMMANDS:
        argv = [argv[0], "--data-workers", str(data_workers)] + argv[1:]

    out, err = io.StringIO(), io.StringIO()
    exc = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            os.chdir(cwd)
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 - the fuzzer's whole point: anything escaping main is a finding
            rc = None
            exc = traceback.format_exc()
    return {"rc": rc, "err": err.getvalue()[-4000:], "exc": exc}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-memory", type=int, default=2 << 30, help="bytes (RLIMIT_DATA)")
    parser.add_argument("--data-workers", type=int, help="as the CLI's --data-workers, for every case")
    parser.add_argument("--stacks", help="file where SIGUSR1 writes every thread's Python stack (a hang's report)")
    args = parser.parse_args()
    if args.stacks:
        stacks = open(args.stacks, "w")  # noqa: SIM115 - open for the life of the process
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    resource.setrlimit(resource.RLIMIT_DATA, (args.max_memory, args.max_memory))
    # The protocol owns the real stdout; stray writes to fd 1/2 (C libraries) go nowhere.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import superneurons.cli  # noqa: F401 - import before the first case so its time is not the case's

    channel.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        channel.write(json.dumps(run_case(request["argv"], request["cwd"], args.data_workers)) + "\n")


if __name__ == "__main__":
    main()
