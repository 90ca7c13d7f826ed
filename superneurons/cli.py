"""`superneurons COMMAND ...`: Caffe's command line (train, test, time, device_query) plus our own.

Each command is a module in `superneurons/commands/` with `register(subparsers)`; adding a
command touches only its own file. A user's mistake (`UserError`) prints one line and exits 1;
`--debug` shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from superneurons import __version__, commands
from superneurons.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        if getattr(args, "debug", False):
            raise
        print(f"superneurons {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `superneurons train ... | head`: the reader left; stop quietly like other Unix tools.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print(f"superneurons {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
