"""Runs cases in a worker process and classifies what happened.

Outcomes: `ok` (exit 0), `error` (exit 1 or 2 with the CLI's one-line `superneurons CMD: error: ...`),
`traceback` (an exception escaped the CLI, or the error was not one line), `signal` (the process died,
e.g. SIGBUS/SIGSEGV/SIGKILL), `hang` (no answer within the time limit), `midway` (the memory pool ran out
after setup: the plan promised a run it could not keep).
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("ok", "error", "traceback", "signal", "hang", "midway")
RESTART_EVERY = 300  # cases per worker: bounds what a long run leaks (threads, open databases)
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


class WorkerStartError(RuntimeError):
    """The worker process did not come up: nothing can be fuzzed (not a finding)."""


def child_setup(nice: int, parent_death: signal.Signals):
    """What a child of the fuzzer runs before it starts: its niceness, and a signal when its parent dies
    (Linux), so that a fuzzer killed with SIGKILL leaves no worker running on its own."""
    parent = os.getpid()

    def setup() -> None:
        if nice:
            os.nice(nice)
        if _LIBC.prctl(_PR_SET_PDEATHSIG, int(parent_death)) == 0 and os.getppid() != parent:
            os._exit(1)  # the parent died before the signal was armed

    return setup


@dataclass
class Result:
    outcome: str
    detail: str  # the error line, the traceback's last lines, the signal's name
    seconds: float


def classify(answer: dict) -> tuple[str, str]:
    if answer.get("exc"):
        return "traceback", answer["exc"]
    rc = answer["rc"]
    if rc == 0:
        return "ok", ""
    lines = [l for l in answer["err"].splitlines() if l.strip()]
    if rc in (1, 2) and lines and "Traceback" not in answer["err"]:
        last = lines[-1]
        if "memory pool exhausted" in last and "during setup" not in last:
            return "midway", last  # the plan let the run start, then the pool ran out: a broken promise
        if rc == 2 or (last.startswith("superneurons ") and ": error: " in last):
            return "error", last
    return "traceback", f"exit {rc}, stderr: {answer['err'][-1500:]}"


class Worker:
    def __init__(self, repo: Path, max_memory: int, nice: int = 0, data_workers: int | None = None):
        self.repo = repo
        self.max_memory = max_memory
        self.nice = nice
        self.data_workers = data_workers
        self.proc: subprocess.Popen | None = None
        self.served = 0

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(self.repo), os.environ.get("PYTHONPATH", "")]),
                   PYTHONHASHSEED="0")
        self.stacks = Path(tempfile.mkstemp(prefix="sn-fuzz-stacks-")[1])
        cmd = [sys.executable, str(Path(__file__).with_name("worker.py")), "--max-memory", str(self.max_memory),
               "--stacks", str(self.stacks)]
        if self.data_workers is not None:
            cmd += ["--data-workers", str(self.data_workers)]
        # Its own session: stopping it also stops what it started (decode processes, their forkserver).
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True, preexec_fn=child_setup(self.nice, signal.SIGKILL))
        ready = self._read(120.0)
        if not isinstance(ready, dict) or not ready.get("ready"):
            self.stop()
            raise WorkerStartError("the fuzz worker did not start (run `python tools/fuzz/worker.py` to see why)")
        self.served = 0

    def _read(self, timeout: float) -> dict | str:
        """The worker's answer, or "timeout" (no answer in time), or "eof" (the worker is gone)."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return "timeout"
        line = self.proc.stdout.readline()
        return json.loads(line) if line else "eof"

    def _stacks(self, wait: float = 1.0) -> str:
        """Every thread's Python stack in the (hung) worker, asked for with SIGUSR1 (worker.py --stacks)."""
        assert self.proc is not None
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        time.sleep(wait)
        try:
            return self.stacks.read_text(errors="replace")[-6000:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and whatever it left running
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
            self.stacks.unlink(missing_ok=True)

    def run(self, argv: list[str], cwd: Path, timeout: float) -> Result:
        if self.proc is None or self.proc.poll() is not None or self.served >= RESTART_EVERY:
            self.stop()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        start = time.monotonic()
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd)}) + "\n")
        self.proc.stdin.flush()
        self.served += 1
        answer = self._read(timeout)
        took = time.monotonic() - start
        if isinstance(answer, dict):
            outcome, detail = classify(answer)
            return Result(outcome, detail, took)
        if answer == "timeout":  # alive and silent: a hang; where its threads are goes into the report
            stacks = self._stacks()
            self.stop()
            return Result("hang", f"no answer in {timeout:g} s" + (f"; its threads:\n{stacks}" if stacks else ""),
                          took)
        code = self.proc.wait()
        self.stop()
        name = signal.Signals(-code).name if code < 0 else f"exit {code}"
        return Result("signal", name, took)
