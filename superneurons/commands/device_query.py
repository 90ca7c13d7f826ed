"""`superneurons device_query`: Caffe's device report, plus the cuDNN and cuBLAS versions we would use."""
from __future__ import annotations

import argparse

from superneurons.backend import device_report
from superneurons.commands._options import add_command


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "device_query", run,
                    help="show the GPUs, their memory and the cuDNN/cuBLAS in use",
                    examples="example:\n  superneurons device_query --gpu 0")
    p.add_argument("--gpu", default="all", help="device id or 'all' (default)")
    return p


def run(args) -> int:
    for line in device_report(args.gpu):
        print(line)
    return 0
