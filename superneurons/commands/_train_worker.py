"""`python -m superneurons.commands._train_worker ARGS.json`: one rank started by the local launcher
(parallel/launch.py, which `train` tells to start this module).

ARGS.json holds `train`'s parsed command line; the rank trains exactly as
`mpiexec -n N superneurons train ...` would have it.
"""
from __future__ import annotations

import argparse
import json
import sys

from superneurons.commands.train import run as run_train


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["args"])
    return run_train(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
