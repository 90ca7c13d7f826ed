"""`superneurons device_query`: Caffe's device report, plus the cuDNN and cuBLAS versions we would use."""
from __future__ import annotations

import argparse

from superneurons.backend import device_report


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("device_query", help="show the GPUs, their memory and the cuDNN/cuBLAS in use",
                       epilog="example:\n  superneurons device_query --gpu 0",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="all", help="device id or 'all' (default)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    for line in device_report(args.gpu):
        print(line)
    return 0
