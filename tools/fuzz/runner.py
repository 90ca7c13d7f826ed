"""Runs cases and classifies what happened.

Three ways to run a case (`fuzz.py --mode`):
- `fork` (the default): a fork server (fork_server.py) imports SuperNeurons once and forks a child per case,
  which runs the program as `python -m superneurons ARGV` would, from the server's clean state.
- `fresh`: a new `python -m superneurons ARGV` per case: the reference the other two are checked against
  (tests/test_fuzz.py), and the way to rule the fork server out when a finding looks like one of its own.
- `inprocess`: one worker process runs case after case in itself (worker.py): no fork per case, but a case
  can see what earlier ones left (threads, open databases, module state), so an outcome may depend on them.

Outcomes: `ok` (exit 0), `error` (exit 1 or 2 with the CLI's one-line `superneurons CMD: error: ...`),
`traceback` (an exception escaped the CLI, or the error was not one line), `signal` (the process died,
e.g. SIGBUS/SIGSEGV/SIGKILL), `hang` (no answer within the time limit), `midway` (the memory pool ran out
after setup: the plan promised a run it could not keep), `leak` (a case that exited by itself left its
decode workers' shared memory in /dev/shm; `fork` and `fresh` only).
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("ok", "error", "traceback", "signal", "hang", "midway", "leak")
MODES = ("fork", "fresh", "inprocess")
HERE = Path(__file__).resolve().parent
ERR_TAIL = 4000  # characters of a case's stderr that classification and the report keep
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
        die_with(parent, parent_death)

    return setup


def die_with(parent: int, signum: signal.Signals) -> None:
    """In a child of `parent`: get `signum` when the parent dies (Linux); exit now if it already has."""
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(signum)) == 0 and os.getppid() != parent:
        os._exit(1)  # the parent died before the signal was armed


@dataclass
class Result:
    outcome: str
    detail: str  # the error line, the traceback's last lines, the signal's name
    seconds: float
    rc: int | None = None  # exit status (-N: killed by signal N); None for a hang or an escaped exception


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


def classify_exit(rc: int, err: str) -> tuple[str, str]:
    """A process's exit status (-N: killed by signal N) and stderr, as `classify` takes the worker's answer."""
    if rc < 0:
        return "signal", signal.Signals(-rc).name
    return classify({"rc": rc, "err": err[-ERR_TAIL:], "exc": None})


# The commands that build nets with data layers take --data-workers; a run given one adds it to them.
DATA_WORKER_COMMANDS = ("train", "test", "time")


def with_data_workers(argv: list[str], data_workers: int | None) -> list[str]:
    if data_workers is not None and argv and argv[0] in DATA_WORKER_COMMANDS:
        return [argv[0], "--data-workers", str(data_workers)] + argv[1:]
    return argv


def case_env(repo: Path) -> dict:
    """The environment of every case, whichever the mode: the repository importable, str hashes fixed."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
                PYTHONHASHSEED="0")


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * ERR_TAIL))
            return f.read().decode(errors="replace")[-ERR_TAIL:]
    except OSError:
        return ""


def _result(rc: int, err: str, took: float, left: list[str]) -> Result:
    outcome, detail = classify_exit(rc, err)
    if left and outcome in ("ok", "error"):
        return Result("leak", f"{outcome}, and left {', '.join(sorted(left))} in /dev/shm", took, rc)
    return Result(outcome, detail, took, rc)


def remove_rings(pid: int) -> list[str]:
    """Unlink the slot rings process `pid` made (`superneurons-PID-*`); returns their names."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(f"superneurons-{pid}-")]
    except OSError:
        return []
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    return names


def read_answer(proc: subprocess.Popen, timeout: float) -> dict | str:
    """A JSON line from a fork server's or worker's stdout, or "timeout" (no answer in time), or "eof" (it is
    gone)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        return "timeout"
    line = proc.stdout.readline()
    return json.loads(line) if line else "eof"


class ForkServer:
    """Cases in children forked by fork_server.py; the server lives for the whole shard (a case that dies or
    hangs is a child: the server goes on)."""

    def __init__(self, repo: Path, max_memory: int, nice: int = 0, data_workers: int | None = None,
                 files: Path | None = None):
        self.repo, self.max_memory, self.nice, self.data_workers = repo, max_memory, nice, data_workers
        self.proc: subprocess.Popen | None = None
        self.files = _files_folder(files)
        self.stacks = self.files / "stacks"

    def _start(self) -> None:
        cmd = [sys.executable, str(HERE / "fork_server.py"), "--max-memory", str(self.max_memory),
               "--stacks", str(self.stacks)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=case_env(self.repo), start_new_session=True,
                                     preexec_fn=child_setup(self.nice, signal.SIGKILL))
        ready = self._read(120.0)
        if not isinstance(ready, dict) or not ready.get("ready"):
            self.stop()
            raise WorkerStartError("the fuzz fork server did not start (run `python tools/fuzz/fork_server.py` "
                                   "to see why)")

    def _read(self, timeout: float) -> dict | str:
        assert self.proc is not None
        return read_answer(self.proc, timeout)

    def run(self, argv: list[str], cwd: Path, timeout: float) -> Result:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        out, err = self.files / "stdout", self.files / "stderr"
        request = {"argv": with_data_workers(argv, self.data_workers), "cwd": str(cwd), "timeout": timeout,
                   "out": str(out), "err": str(err), "env": None}
        start = time.monotonic()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout + 30.0)  # the server itself answers a hang after `timeout`
        took = time.monotonic() - start
        if not isinstance(answer, dict):
            self.stop()
            raise WorkerStartError(f"the fuzz fork server stopped answering ({answer}) in a case in {cwd}")
        if answer["hang"]:
            stacks = answer["stacks"]
            return Result("hang", f"no answer in {timeout:g} s" + (f"; its threads:\n{stacks}" if stacks else ""),
                          took)
        return _result(answer["rc"], _tail(err), took, answer["left"])

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server; a case's own session dies by PDEATHSIG or
            except ProcessLookupError:                   # its own end (the server kills it after each case)
                pass
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.files, ignore_errors=True)


class FreshProcess:
    """Each case as a new `python -m superneurons ARGV` process: what the fork server must match."""

    def __init__(self, repo: Path, max_memory: int, nice: int = 0, data_workers: int | None = None,
                 files: Path | None = None):
        self.repo, self.max_memory, self.nice, self.data_workers = repo, max_memory, nice, data_workers
        self.files = _files_folder(files)
        self.env = case_env(repo)

    def run(self, argv: list[str], cwd: Path, timeout: float) -> Result:
        out, err = self.files / "stdout", self.files / "stderr"
        setup = child_setup(self.nice, signal.SIGKILL)
        limit = self.max_memory

        def preexec() -> None:
            setup()
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

        start = time.monotonic()
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen([sys.executable, "-m", "superneurons", *with_data_workers(argv, self.data_workers)],
                                    cwd=cwd, stdin=subprocess.DEVNULL, stdout=o, stderr=e, env=self.env,
                                    start_new_session=True, preexec_fn=preexec)
        try:
            proc.wait(timeout)
            hang = False
        except subprocess.TimeoutExpired:
            hang = True
        took = time.monotonic() - start
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the case, if hung, and whatever it left running
        except ProcessLookupError:
            pass
        code = proc.wait()
        left = remove_rings(proc.pid)
        if hang:
            return Result("hang", f"no answer in {timeout:g} s", took)
        return _result(code, _tail(err), took, [] if code < 0 else left)

    def stop(self) -> None:
        pass

    def close(self) -> None:
        shutil.rmtree(self.files, ignore_errors=True)


def _files_folder(files: Path | None) -> Path:
    """Where a case's stdout and stderr go: `files` (a shard puts it in its own folder, which the fuzzer removes
    even when the shard was killed), or a new temporary folder."""
    if files is None:
        return Path(tempfile.mkdtemp(prefix="sn-fuzz-case-"))
    files.mkdir(parents=True, exist_ok=True)
    return files


def make_runner(mode: str, repo: Path, max_memory: int, nice: int = 0, data_workers: int | None = None,
                files: Path | None = None):
    """The runner of `mode` (MODES); each has run(argv, cwd, timeout) -> Result and close(). `files`: the
    folder for the cases' output files (fork, fresh)."""
    if mode == "inprocess":
        return Worker(repo, max_memory, nice, data_workers)
    return {"fork": ForkServer, "fresh": FreshProcess}[mode](repo, max_memory, nice, data_workers, files)


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
        assert self.proc is not None
        return read_answer(self.proc, timeout)

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

    def close(self) -> None:
        self.stop()

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
            return Result(outcome, detail, took, answer["rc"])
        if answer == "timeout":  # alive and silent: a hang; where its threads are goes into the report
            stacks = self._stacks()
            self.stop()
            return Result("hang", f"no answer in {timeout:g} s" + (f"; its threads:\n{stacks}" if stacks else ""),
                          took)
        code = self.proc.wait()
        self.stop()
        name = signal.Signals(-code).name if code < 0 else f"exit {code}"
        return Result("signal", name, took, code)
