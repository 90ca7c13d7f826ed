"""What SIGINT (Ctrl-C) and SIGHUP do to a training run: Caffe's `-sigint_effect` / `-sighup_effect`.

Each signal maps to one effect: `stop` (finish the iteration, then end training as if max_iter had
been reached, which writes the final snapshot when snapshot_after_train is on, its default),
`snapshot` (finish the iteration, write a snapshot, go on) or `none` (ignore the signal). Caffe's
defaults: SIGINT stops, SIGHUP snapshots.

The handler only records the request; the solver acts on it between iterations (`SignalEffects.take`),
so a snapshot never sees half-updated weights. A second SIGINT that arrives before the first was acted
on (an iteration or a test pass can take long) stops training at once: KeyboardInterrupt, which the command
line reports in one line with exit code 130.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Callable

from superneurons.errors import UserError

EFFECTS = ("stop", "snapshot", "none")
DEFAULT_SIGINT = "stop"
DEFAULT_SIGHUP = "snapshot"


def check_effect(flag: str, effect: str) -> str:
    if effect not in EFFECTS:
        raise UserError(f"{flag} {effect!r}: expected one of {', '.join(EFFECTS)}")
    return effect


class SignalEffects:
    """The requested effects of SIGINT and SIGHUP, and the pending request while training runs."""

    def __init__(self, sigint: str = DEFAULT_SIGINT, sighup: str = DEFAULT_SIGHUP,
                 say: Callable[[str], None] | None = None):
        self.effects = {signal.SIGINT: check_effect("--sigint-effect", sigint)}
        if hasattr(signal, "SIGHUP"):  # not on Windows
            self.effects[signal.SIGHUP] = check_effect("--sighup-effect", sighup)
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.pending: str | None = None
        self.at_once = False  # a second Ctrl-C came: stop now, without a snapshot

    def take(self) -> str | None:
        """The effect requested since the last call ("stop" or "snapshot"), or None. A second Ctrl-C whose
        KeyboardInterrupt was swallowed (raised inside a ctypes callback, such as numba's compiler's, which
        only prints it) stops the run here, at the end of the iteration, rather than with a snapshot."""
        if self.at_once:
            raise KeyboardInterrupt
        action, self.pending = self.pending, None
        return action

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        effect = self.effects[signum]
        if signum == signal.SIGINT and self.pending is not None:
            try:
                self.say(f"{name} again: stopping now, without a snapshot")
            except (OSError, ValueError):
                pass
            # Unwinds from wherever training is (a half-written snapshot removes itself, data workers and
            # shared memory are released); the command line turns it into one line and exit code 130.
            self.at_once = True
            raise KeyboardInterrupt
        if self.pending != "stop":  # a stop already asked for stays a stop
            self.pending = effect
        what = "stopping" if effect == "stop" else "writing a snapshot"
        try:
            self.say(f"{name} received: {what} after this iteration" +
                     (" (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""))
        except (OSError, ValueError):  # SIGHUP often means the terminal is gone: the request still stands
            pass

    def install(self) -> Callable[[], None]:
        """Install the handlers; returns what puts the previous ones back. Only the main thread may
        install handlers: elsewhere this does nothing (the signals keep Python's behaviour)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {}
        for signum, effect in self.effects.items():
            handler = signal.SIG_IGN if effect == "none" else self._on_signal
            previous[signum] = signal.signal(signum, handler)

        def release() -> None:
            for signum, old in previous.items():
                signal.signal(signum, old if old is not None else signal.SIG_DFL)

        return release
