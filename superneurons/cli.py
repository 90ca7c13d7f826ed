"""`superneurons COMMAND ...`: Caffe's command line (train, test, time, device_query) plus our own.

Each command is a module in `superneurons/commands/` with `register(subparsers)`; adding a
command touches only its own file. A user's mistake (`UserError`) prints one line and exits 1;
`--debug` shows the traceback. Ctrl-C, at any moment including start-up, ends with one line and
exit code 130.

Caffe's spellings work beside ours: gflags writes `-solver x`, `-solver=x` and `--sigint_effect`,
argparse `--solver x` and `--sigint-effect`. `CaffeFlagParser` rewrites a command's arguments to
the argparse spelling before parsing, for the options that command has.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
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


def main(argv: list[str] | None = None) -> int:
    command, args = "superneurons", None
    try:
        parser = build_parser()  # imports every command: Ctrl-C may land here too
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        command = f"superneurons {args.command}"
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
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
