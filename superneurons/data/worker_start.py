"""Where a decode worker process starts: it ignores Ctrl-C before anything else is imported.

A worker is forked from the multiprocessing fork server with Python's default SIGINT handler restored, and
its first act is to unpickle its target, which imports that target's module. The terminal sends Ctrl-C to
the whole process group, workers included; the parent handles it (it stops the run and closes the workers).
A worker still importing NumPy and the decoders when the signal came died of a KeyboardInterrupt, which
the parent then reported as a worker death. This module is the target: importing it is the first thing the
worker does, and it imports nothing heavy before it ignores the signal; the real target comes as an argument.
"""
from __future__ import annotations

import signal
from multiprocessing import process

# True only in a new process while it unpickles what it runs (multiprocessing's spawn and forkserver);
# the parent imports this module too, and keeps its own Ctrl-C handling.
if getattr(process.current_process(), "_inheriting", False):
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run(target, *args) -> None:
    """Call `target(*args)`. The process unpickles this function before its arguments, `target` among them, so
    the signal is ignored before their modules (NumPy, the decoders) load."""
    target(*args)
