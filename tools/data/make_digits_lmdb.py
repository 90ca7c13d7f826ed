#!/usr/bin/env python3
"""Write the embedded digits dataset (scikit-learn's 1797 digits at 28x28) as Caffe LMDBs.

    python tools/make_digits_lmdb.py --out data/digits

Creates data/digits/train_lmdb (1497 records) and data/digits/test_lmdb (300 records); does
nothing when both are already complete.
"""
from __future__ import annotations

import argparse
import sys

from superneurons.data.digits import make_digits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/digits", help="folder for train_lmdb and test_lmdb")
    args = parser.parse_args(argv)
    make_digits(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
