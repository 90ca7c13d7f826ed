"""Starting a data-parallel training: which kind of run `--gpu` asks for, and the local launcher.

`superneurons train --gpu 0,1,2,3` (or `--gpu all` on a machine with several GPUs) starts one worker
process per GPU through the MPI launcher installed beside this Python (`mpiexec` from the `mpich` wheel),
exactly as `mpiexec -n 4 superneurons train ... --gpu 0,1,2,3` would, and waits for them. The workers get
the parsed command line in a file (`commands/_train_worker.py`), so every flag of `train` reaches them unchanged.

A failing rank writes its one-line message into the launcher's folder and ends the job (MPI_Abort: the
launcher kills the other ranks); the launcher then reports that message as its own error. A rank that dies
without a message (kill -9, the kernel's out-of-memory killer) is named from MPI's report of the dead
process, matched to its rank by the pid every rank writes into the same folder. MPI's own lines about the
abort are left out of the output.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from superneurons.errors import UserError
from superneurons.parallel.devices import parse_gpus
from superneurons.parallel.world import launched_by_mpi

ERRORS_ENV = "SUPERNEURONS_DP_ERRORS"  # folder where a failing worker writes rank-<r>.txt
# MPICH's report of a process that died: "=   PID 123 RUNNING AT host", "EXIT STRING: Killed (signal 9)"
# (Open MPI words it otherwise; a rank killed under it gets the launcher's generic line).
_DEAD_PID = re.compile(r"^=\s+PID (\d+) RUNNING AT (\S+)")
_EXIT_STRING = re.compile(r"EXIT STRING: (.+?)\s*$")
# MPICH (hydra) and Open MPI lines about an abort; the rank's own message says what happened.
_MPI_NOISE = re.compile(r"^(Abort\(\d+\)|application called MPI_Abort|=+\s*$|=\s{2,}|\[proxy:|\[mpiexec@|"
                        r"-{20,}\s*$|MPI_ABORT was invoked|NOTE: invoking MPI_ABORT|You may or may not see|"
                        r"with errorcode|\[\S+:\d+\] \d+ more process|YOUR APPLICATION TERMINATED|This typically refers to a problem|"
                        r"Please see the FAQ page)")


@dataclass
class Job:
    spawn: bool = False  # start one process per GPU in `gpus` and wait
    rank: bool = False  # this process is one rank of an MPI job
    gpus: list[int] | None = None  # the GPUs named by --gpu (None: none named)


def plan(gpu_flag: str | None) -> Job:
    """What `--gpu` (and whether an MPI launcher started us) asks for."""
    named = gpu_flag is not None and gpu_flag.strip() not in ("", "-1")
    gpus = parse_gpus(gpu_flag) if named else None
    if launched_by_mpi():
        return Job(rank=True, gpus=gpus)
    if gpus is not None and len(gpus) > 1:
        return Job(spawn=True, gpus=gpus)
    return Job(gpus=gpus)


def find_mpiexec() -> str:
    """The MPI launcher installed beside this Python (the venv's bin), else the one on PATH."""
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpiexec", path=here) or shutil.which("mpiexec")
    if found is None:
        raise UserError("training on several GPUs starts one process per GPU with mpiexec, which is not installed; "
                        "install it with `pip install mpi4py mpich`")
    return found


def worker_command(n: int, args_file: str, entry: str) -> list[str]:
    return [find_mpiexec(), "-n", str(n), sys.executable, "-m", entry, args_file]


def spawn(args: Any, gpus: list[int], entry: str) -> int:
    """Run `train` on every GPU of `gpus`, one process each, and wait; a failed rank's message becomes ours.
    `entry`: the module each process runs with the parsed command line's file (`python -m entry ARGS.json`;
    the command names it, so this package needs nothing of the commands)."""
    with tempfile.TemporaryDirectory(prefix="superneurons-dp-") as folder:
        args_file = os.path.join(folder, "args.json")
        fields = {k: v for k, v in vars(args).items() if k != "func"}
        with open(args_file, "w", encoding="utf-8") as f:
            json.dump({"args": fields}, f)
        env = dict(os.environ, **{ERRORS_ENV: folder})
        proc = subprocess.Popen(worker_command(len(gpus), args_file, entry), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace")
        death = DeathReport()  # MPICH (the launcher we install) writes its report on stdout
        assert proc.stdout is not None and proc.stderr is not None
        out = threading.Thread(target=_relay, args=(proc.stdout, sys.stdout, death), daemon=True)
        out.start()
        try:
            _relay(proc.stderr, sys.stderr, death)
            code = proc.wait()
            out.join()
        except KeyboardInterrupt:
            # The ranks got the same Ctrl-C: they agree to stop, rank 0 snapshots; wait for that.
            code = _wait_after_interrupt(proc)
        if code != 0:
            message = first_rank_error(folder) or death.describe(rank_pids(folder))
            raise UserError(message or f"a worker process ended with exit code {code} and no message "
                            f"(killed, out of host memory?); every rank has been stopped")
    return 0


class DeathReport:
    """What MPI's launcher said about a process that died without a message of its own."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.host = ""
        self.how = ""

    def read(self, line: str) -> None:  # lines from two threads: each field is set once, by one of them
        if (m := _DEAD_PID.match(line)) and self.pid is None:
            self.pid, self.host = int(m.group(1)), m.group(2)
        elif (m := _EXIT_STRING.search(line)) and not self.how:
            self.how = m.group(1)

    def describe(self, ranks_by_pid: dict[int, int]) -> str | None:
        if self.pid is None:
            return None
        rank = ranks_by_pid.get(self.pid)
        who = f"rank {rank} (pid {self.pid} on {self.host})" if rank is not None else f"pid {self.pid} on {self.host}"
        how = self.how or "ended"
        if m := re.search(r"signal (\d+)", how):
            signal_number = int(m.group(1))
            how = f"was killed by signal {signal_number} ({_signal_name(signal_number)}) without a message"
            if signal_number == 9:
                how += " (out of host memory: the kernel's OOM killer; or killed from outside)"
        else:
            how = f"ended without a message ({how})"
        return f"{who} {how}; every rank has been stopped"


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def pid_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank-{rank}.pid")


def rank_pids(folder: str) -> dict[int, int]:
    """pid -> rank, from the pid files the ranks wrote at start."""
    found: dict[int, int] = {}
    for name in os.listdir(folder):
        if m := re.fullmatch(r"rank-(\d+)\.pid", name):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    found[int(f.read().strip())] = int(m.group(1))
            except (OSError, ValueError):
                continue
    return found


def _relay(source: Any, sink: Any, death: "DeathReport") -> None:
    """The workers' lines, less MPI's chatter about an abort, whose facts `death` keeps."""
    for line in source:
        death.read(line)
        if not _MPI_NOISE.match(line):
            sink.write(line)
            sink.flush()


def _wait_after_interrupt(proc: subprocess.Popen) -> int:
    try:
        return proc.wait()
    except KeyboardInterrupt:  # a second Ctrl-C: stop the launcher, which stops its processes
        proc.terminate()
        return proc.wait()


def error_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank-{rank}.txt")


def first_rank_error(folder: str) -> str | None:
    """The message of the rank that failed first (others may fail in turn as the job ends)."""
    found = sorted((os.stat(os.path.join(folder, name)).st_mtime_ns, int(m.group(1)), name)
                   for name in os.listdir(folder) if (m := re.fullmatch(r"rank-(\d+)\.txt", name)))
    for _when, _rank, name in found:
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
        if text:
            return text
    return None
