"""`superneurons COMMAND ...`: Caffe's command line (train, test, time, device_query) plus our own.

Each command is a module in `superneurons/commands/` with `register(subparsers)`; adding a
command touches only its own file. A user's mistake (`UserError`) prints one line and exits 1;
`--debug` shows the traceback. Ctrl-C, at any moment including start-up, ends with one line and
exit code 130. `run` is the program (`superneurons`, `python -m superneurons`); `main` the same
without the process's exit, for callers in Python.

Caffe's spellings work beside ours: gflags writes `-solver x`, `-solver=x` and `--sigint_effect`,
argparse `--solver x` and `--sigint-effect`. `CaffeFlagParser` rewrites a command's arguments to
the argparse spelling before parsing, for the options that command has.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import pkgutil
import re
import signal
import sys

from superneurons import __version__, commands
from superneurons.errors import UserError

# `-name`, `--name`, `-name=value`: an option token (a name starts with a letter, so `-1` stays a value).
_OPTION_TOKEN = re.compile(r"--?([A-Za-z][A-Za-z0-9_-]+)(=.*)?", re.DOTALL)


class CaffeFlagParser(argparse.ArgumentParser):
    """An ArgumentParser that also takes gflags' spellings of its long options (see the module docstring)."""

    def long_options(self) -> set[str]:
        # The parser's own table of option strings (argument groups add theirs to it too).
        return {o for o in self._option_string_actions if o.startswith("--")}

    def caffe_spelling(self, argv: list[str]) -> list[str]:
        """`-gpu 0`, `-gpu=0`, `--sighup_effect none` -> `--gpu 0`, `--gpu=0`, `--sighup-effect none` for the
        options this parser has; anything else (values, `--` and what follows it) is left alone."""
        known = self.long_options()
        out = []
        for k, token in enumerate(argv):
            if token == "--":
                return out + argv[k:]
            m = _OPTION_TOKEN.fullmatch(token)
            canonical = "--" + m.group(1).replace("_", "-") if m else None
            out.append(canonical + (m.group(2) or "") if canonical in known else token)
        return out

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.caffe_spelling(argv), namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = CaffeFlagParser(
        prog="superneurons",
        description="Train Caffe networks larger than your GPU's memory.",
        epilog="Run `superneurons COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"superneurons {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue  # shared helpers, not commands
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = module.register(sub)
        p.add_argument("--debug", action="store_true", help="show a Python traceback on errors")
    return parser


class _Interruption:
    """What the line about a Ctrl-C names (the command being run), and whether it was said already."""

    command = "superneurons"
    said = False

    @classmethod
    def say(cls) -> int:
        if not cls.said:
            cls.said = True  # first: a second Ctrl-C acted on just after the print must not print it again
            print(f"{cls.command}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    command, args = "superneurons", None
    _Interruption.command, _Interruption.said = command, False
    try:
        parser = build_parser()  # imports every command: Ctrl-C may land here too
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        command = _Interruption.command = f"superneurons {args.command}"
        try:
            return int(args.func(args) or 0)
        finally:
            # Decode workers and their shared memory go before the command returns, where a Ctrl-C is still
            # answered as an interruption (not in an exit handler). None started if the module was never loaded.
            workers = sys.modules.get("superneurons.data.workers")
            if workers is not None:
                workers.close_pools()
    except UserError as e:
        if getattr(args, "debug", False):
            raise
        print(f"{command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `superneurons train ... | head`: the reader left; stop quietly like other Unix tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return _Interruption.say()


def _stop_at_once(signum, frame) -> None:
    """Ctrl-C once the command has returned, while Python exits (threads, exit handlers): stop now. The
    command's work is done or stopped and its pools are closed; what is skipped is the interpreter's tidying."""
    _Interruption.say()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(130)


def _ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def forget_unhandled_interrupt() -> None:
    """CPython marks a KeyboardInterrupt that left code run by exec() or eval() of a string (numba's compiler,
    dataclasses, namedtuple and site's .pth lines run code so) as unhandled even when a caller then caught it,
    and after its exit ends a `python -m` run with SIGINT (status -2) whatever exit code was asked for. Every
    exec of a string starts that mark afresh: a caller that has answered every Ctrl-C calls this before it exits."""
    exec("")


def run() -> None:
    """The program: `main()`, then the process's exit, where a Ctrl-C is answered as anywhere else (one line,
    exit code 130) rather than as Python's default: after the exit handlers Python puts back SIGINT's default
    action, and a Ctrl-C there killed the process (status -2) without a word, after a run that had stopped
    cleanly on the first Ctrl-C and written its snapshot. The last exit handler therefore ignores SIGINT
    (Python leaves an ignored signal ignored): from there to the end the exit is short and cannot hang."""
    code: int | str | None
    try:
        atexit.register(_ignore_ctrl_c)  # registered first, so it runs last of the exit handlers
        code = main()
        signal.signal(signal.SIGINT, _stop_at_once)
    except SystemExit as e:  # argparse's --help, --version and usage errors
        signal.signal(signal.SIGINT, _stop_at_once)
        code = e.code
    except KeyboardInterrupt:  # after main answered one Ctrl-C (a second one), or in its first or last steps
        signal.signal(signal.SIGINT, _stop_at_once)  # first: a Ctrl-C can be acted on only after this call
        code = _Interruption.say()
    forget_unhandled_interrupt()
    sys.exit(code)


if __name__ == "__main__":
    run()
