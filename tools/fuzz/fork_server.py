"""The fuzzer's fork server: imports SuperNeurons once, then forks one child per case, which runs the program
(`superneurons.cli.run`, as `python -m superneurons ARGV` does) and exits as that process would.

Start-up is most of a short case's time in a fresh interpreter (about 1 s of imports for a command that fails
in 10 ms); a fork costs a few milliseconds. Unlike running cases one after another in one process, each
case starts from the same state, the server's: nothing a case leaves (open LMDB environments, threads,
numba's compiled functions, module globals, exit handlers, decode processes, a multiprocessing fork server
or resource tracker) reaches the next. The server itself never runs a command, starts a thread or a
process, so the fork copies nothing half-done.

One JSON line in, one JSON line out (the server's real stdin and stdout; fds 0-2 are /dev/null in it):

    {"argv": [...], "cwd": "/tmp/c", "timeout": 60, "out": "/tmp/o", "err": "/tmp/e", "env": null}
    ->  {"pid": 123, "rc": 1, "hang": false, "stacks": "", "left": []}

`rc` is the exit status, -N for death by signal N. After `timeout` seconds the child is a hang: SIGUSR1 makes
it write every thread's Python stack to `--stacks` (faulthandler, registered here and kept across fork), then
its whole session (the decode workers, their server, its resource tracker) is killed. Whatever ends the
case, its session is killed after it (what a fresh process's run left behind goes with it) and the slot rings
it made in /dev/shm (`superneurons-PID-*`) are removed; `left` names those a child that exited by itself left.
"""
from __future__ import annotations

import argparse
import atexit
import faulthandler
import gc
import importlib
import json
import logging
import os
import pkgutil
import resource
import select
import signal
import sys
import threading
import time
import types

from runner import die_with, remove_rings  # this file's folder is first on sys.path

STACKS_WAIT_S = 1.0  # how long a hung child has to write its stacks before it is killed
# Never imported here: the CUDA backend initializes a driver the children would share; __main__ runs the program.
NOT_PRELOADED = ("superneurons.backend.cuda", "superneurons.__main__")


def preload() -> None:
    """Import what a case would import, so that no child pays for it: the command line and its commands,
    every module of the package (the CPU backend with numba, the layers, the data sources), and the
    libraries the data sources load lazily. Importing runs no command: no thread, process or file stays open."""
    import superneurons
    from superneurons import cli

    cli.build_parser()  # imports every command
    for info in pkgutil.walk_packages(superneurons.__path__, "superneurons."):
        if not info.name.startswith(NOT_PRELOADED):
            importlib.import_module(info.name)
    for name in ("h5py", "plyvel"):
        try:
            importlib.import_module(name)
        except ImportError:  # optional: a case needing it says so, as in a fresh process
            pass
    from PIL import Image

    Image.init()  # every image plugin, which Pillow otherwise imports at the first open
    warm_kernels()


def warm_kernels() -> None:
    """Load the CPU backend's numba kernels (from numba's cache on disk, or compiled) for the dtypes the layers
    run them in: each load costs a child about 0.5 s. The same machine code a fresh process loads; what the
    children inherit is the loaded function, not any data of a case."""
    import numpy as np

    from superneurons.backend.cpu.pooling import pool_backward, pool_forward
    from superneurons.backend.geometry import PoolGeometry

    for dtype in (np.float32, np.float64):
        x, dx = np.ones((1, 1, 4, 4), dtype), np.zeros((1, 1, 4, 4), dtype)
        y, dy = np.zeros((1, 1, 2, 2), dtype), np.ones((1, 1, 2, 2), dtype)
        mask = np.zeros((1, 1, 2, 2), np.int32)
        for method in ("max", "ave", "stochastic"):
            geom = PoolGeometry(method, (2, 2), (2, 2))
            pool_forward(x, y, mask if method == "max" else None, geom)
            if method != "stochastic":
                pool_backward(dy, mask if method == "max" else None, dx, geom)


def check_clean() -> None:
    """What a child inherits must be what a fresh process has before it runs the program: one thread, no
    multiprocessing helper process (fork server, resource tracker) and no decode workers' context, no shared
    memory of ours. A preload that broke this would make every case share it; the server refuses to start."""
    import multiprocessing.forkserver as mp_forkserver
    import multiprocessing.resource_tracker as mp_tracker

    from superneurons.data import workers

    problems = [what for what, bad in (
        (f"threads {threading.enumerate()}", threading.active_count() != 1),
        ("a multiprocessing resource tracker", mp_tracker._resource_tracker._pid is not None),
        ("a multiprocessing fork server", mp_forkserver._forkserver._forkserver_pid is not None),
        ("the decode workers' multiprocessing context", workers._context is not None),
        ("logging handlers", bool(logging.root.handlers)),
    ) if bad]
    if problems:
        raise RuntimeError(f"the fork server's state after preloading is not a fresh process's: {', '.join(problems)}")


def _program_main() -> types.ModuleType:
    """A `__main__` module as `python -m superneurons` has: multiprocessing reads it to prepare the decode
    workers, and skips importing a package's `__main__` (this file would be imported in every worker)."""
    from importlib.util import find_spec

    spec = find_spec("superneurons.__main__")
    main = types.ModuleType("__main__")
    main.__spec__, main.__file__ = spec, spec.origin
    main.__builtins__ = __builtins__
    return main


def become_case(request: dict, keep: list, server: int) -> None:
    """In the forked child: the process of `python -m superneurons ARGV` at the moment it runs the program.
    Does not return: the program's SystemExit (or exception) ends the interpreter as it ends a fresh one,
    exit handlers and all."""
    os.setsid()  # a session of its own: killing it stops whatever the case started
    die_with(server, signal.SIGKILL)  # a server stopped (end of run, Ctrl-C) takes its case along
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for f in keep:  # the protocol's pipes are the server's, not the case's
        f.close()
    for fd, path in ((1, request["out"]), (2, request["err"])):
        new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(new, fd)
        os.close(new)
    if request.get("env") is not None:
        os.environ.clear()
        os.environ.update(request["env"])
    os.chdir(request["cwd"])
    main = _program_main()
    sys.argv = [main.__file__, *request["argv"]]
    sys.path[0] = os.getcwd()  # `python -m` puts the working folder first, where this file's folder was
    sys.modules["__main__"] = main
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh process seeds NumPy's global generator from the OS; the fork copied ours
        numpy.random.seed()
    from superneurons.cli import run

    try:
        run()  # raises SystemExit
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - what the interpreter does with an exception that ends the program
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_as_python_does(code)


def exit_as_python_does(code) -> None:
    """The interpreter's exit, less the teardown of every module (0.7 s with the ~900 modules loaded): wait for
    the threads that are not daemons, run the exit handlers, collect the garbage (finalizers run, as they do at a
    fresh process's exit; the server's own objects were frozen out of the collector's reach, so this sees only
    the case's), flush the standard streams, then leave with the status SystemExit's code gives."""
    threading._shutdown()  # what Py_FinalizeEx does first (threading's own hook for it)
    atexit._run_exitfuncs()
    gc.collect()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 120  # as CPython: a failure to flush stdout at exit is status 120
    os._exit(status)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_case(pid: int, timeout: float, stacks: str | None) -> dict:
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        hang, where = not ready, ""
        if hang:
            start = os.path.getsize(stacks) if stacks else 0
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
            time.sleep(STACKS_WAIT_S)
            if stacks:
                with open(stacks, errors="replace") as f:
                    f.seek(start)
                    where = f.read()[-6000:].strip()
            _kill_session(pid)
            os.kill(pid, signal.SIGKILL)  # it may not have reached setsid
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    _kill_session(pid)  # what it left running, as the fresh-process runner kills the session
    left = remove_rings(pid)
    return {"pid": pid, "rc": os.waitstatus_to_exitcode(status), "hang": hang, "stacks": where,
            "left": [] if hang or os.WIFSIGNALED(status) else left}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-memory", type=int, default=2 << 30, help="bytes (RLIMIT_DATA), for every case")
    parser.add_argument("--stacks", help="file where SIGUSR1 writes every thread's Python stack (a hang's report)")
    args = parser.parse_args()
    if args.stacks:
        stacks = open(args.stacks, "w")  # noqa: SIM115 - open for the life of the process, and of every child
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    resource.setrlimit(resource.RLIMIT_DATA, (args.max_memory, args.max_memory))
    requests = os.fdopen(os.dup(0), "r")
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # stray writes go nowhere; each child gets its own files
        os.dup2(devnull, fd)
    os.close(devnull)
    preload()
    check_clean()
    gc.collect()
    gc.freeze()  # the children never collect (or touch, page by page) the server's objects: see exit_as_python_does
    channel.write(json.dumps({"ready": True}) + "\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            become_case(request, [requests, channel], server)
        channel.write(json.dumps(wait_case(pid, request["timeout"], args.stacks)) + "\n")


if __name__ == "__main__":
    main()
