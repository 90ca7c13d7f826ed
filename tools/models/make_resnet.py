#!/usr/bin/env python
"""Write a deep bottleneck ResNet (He et al. 2016) as a training prototxt fed by DummyData.

    python tools/models/make_resnet.py --blocks 3,4,6,3 --out resnet50.prototxt          # ResNet-50
    python tools/models/make_resnet.py --blocks 6,32,300,6 --batch 8 --out resnet1034.prototxt

Four stages of bottleneck blocks with base widths 64, 128, 256, 512 (each block: 1x1 w, 3x3 w, 1x1 4w), every
convolution followed by BatchNorm + Scale (+ ReLU except before the sum), a projection shortcut (1x1 conv + BN +
Scale) on the first block of every stage, stride 2 on the first block of stages 3-5 (in the 1x1 `branch2a`, as
the original Caffe ResNets do), global average pooling, fc1000, SoftmaxWithLoss (and Accuracy in TEST).
Layer names follow the published ResNet prototxts (conv1, res2a_branch2a, bn2a_branch2a, scale2a_branch2a, ...).
The depth, 3 * (sum of blocks) + 2 weighted layers, is printed (on stderr when the net goes to stdout).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from google.protobuf import text_format

from superneurons.errors import UserError, exit_status
from superneurons.proto import superneurons_pb2 as pb

WIDTHS = (64, 128, 256, 512)
EXPANSION = 4


def depth_of(blocks: list[int]) -> int:
    """Weighted layers: conv1 + 3 convolutions per bottleneck block + fc (shortcut projections not counted)."""
    return 3 * sum(blocks) + 2


def parse_blocks(text: str) -> list[int]:
    try:
        blocks = [int(b) for b in text.split(",")]
    except ValueError:
        raise UserError(f"--blocks {text!r}: expected four comma-separated integers such as 3,4,6,3") from None
    if len(blocks) != 4 or any(b < 1 for b in blocks):
        raise UserError(f"--blocks {text!r}: expected four block counts, each at least 1 (got {blocks})")
    return blocks


def _block_names(n: int) -> list[str]:
    """a, b, c, ... as ResNet-50 names them (up to 6 blocks); a, b1, b2, ... for longer stages, as ResNet-101/152."""
    if n <= 6:
        return [chr(ord("a") + i) for i in range(n)]
    return ["a"] + [f"b{i}" for i in range(1, n)]


class _Builder:
    def __init__(self, net: pb.NetParameter):
        self.net = net

    def conv_bn(self, bottom: str, suffix: str, out: int, kernel: int, stride: int, pad: int, relu: bool) -> str:
        """conv{suffix} (no bias) + bn{suffix} + scale{suffix} [+ relu], in place after the convolution."""
        conv = "res" + suffix if suffix[0].isdigit() else suffix
        lp = self.net.layer.add(name=conv, type="Convolution", bottom=[bottom], top=[conv])
        cp = lp.convolution_param
        cp.num_output = out
        cp.bias_term = False
        cp.kernel_size.append(kernel)
        if stride != 1:
            cp.stride.append(stride)
        if pad:
            cp.pad.append(pad)
        cp.weight_filler.type = "msra"
        bn_name = "bn" + suffix if suffix[0].isdigit() else "bn_" + suffix
        sc_name = "scale" + suffix if suffix[0].isdigit() else "scale_" + suffix
        bn = self.net.layer.add(name=bn_name, type="BatchNorm", bottom=[conv], top=[conv])
        for _ in range(3):
            bn.param.add(lr_mult=0, decay_mult=0)
        sc = self.net.layer.add(name=sc_name, type="Scale", bottom=[conv], top=[conv])
        sc.scale_param.bias_term = True
        if relu:
            self.net.layer.add(name=conv + "_relu", type="ReLU", bottom=[conv], top=[conv])
        return conv

    def bottleneck(self, bottom: str, tag: str, width: int, stride: int, project: bool) -> str:
        if project:
            shortcut = self.conv_bn(bottom, f"{tag}_branch1", EXPANSION * width, 1, stride, 0, relu=False)
        else:
            shortcut = bottom
        x = self.conv_bn(bottom, f"{tag}_branch2a", width, 1, stride, 0, relu=True)
        x = self.conv_bn(x, f"{tag}_branch2b", width, 3, 1, 1, relu=True)
        x = self.conv_bn(x, f"{tag}_branch2c", EXPANSION * width, 1, 1, 0, relu=False)
        out = "res" + tag
        self.net.layer.add(name=out, type="Eltwise", bottom=[shortcut, x], top=[out])
        self.net.layer.add(name=out + "_relu", type="ReLU", bottom=[out], top=[out])
        return out


def make_resnet(blocks: list[int], batch: int = 32, classes: int = 1000, side: int = 224) -> pb.NetParameter:
    if batch <= 0:
        raise UserError(f"--batch must be positive, got {batch}")
    net = pb.NetParameter(name=f"ResNet-{depth_of(blocks)}")
    data = net.layer.add(name="data", type="DummyData", top=["data", "label"])
    dp = data.dummy_data_param
    dp.shape.add().dim.extend([batch, 3, side, side])
    dp.shape.add().dim.extend([batch])
    dp.data_filler.add(type="gaussian", std=1.0)
    dp.data_filler.add(type="constant", value=1.0)  # an integer class index (a uniform filler gives fractions)

    b = _Builder(net)
    x = b.conv_bn("data", "conv1", 64, 7, 2, 3, relu=True)
    pool = net.layer.add(name="pool1", type="Pooling", bottom=[x], top=["pool1"])
    pool.pooling_param.pool = pb.PoolingParameter.MAX
    pool.pooling_param.kernel_size = 3
    pool.pooling_param.stride = 2
    x = "pool1"
    for stage, (n, width) in enumerate(zip(blocks, WIDTHS), start=2):
        for k, letter in enumerate(_block_names(n)):
            stride = 2 if k == 0 and stage > 2 else 1
            x = b.bottleneck(x, f"{stage}{letter}", width, stride, project=k == 0)
    gap = net.layer.add(name="pool5", type="Pooling", bottom=[x], top=["pool5"])
    gap.pooling_param.pool = pb.PoolingParameter.AVE
    gap.pooling_param.global_pooling = True
    fc = net.layer.add(name=f"fc{classes}", type="InnerProduct", bottom=["pool5"], top=[f"fc{classes}"])
    fc.inner_product_param.num_output = classes
    fc.inner_product_param.weight_filler.type = "msra"
    fc.inner_product_param.bias_filler.type = "constant"
    net.layer.add(name="loss", type="SoftmaxWithLoss", bottom=[f"fc{classes}", "label"], top=["loss"])
    acc = net.layer.add(name="accuracy", type="Accuracy", bottom=[f"fc{classes}", "label"], top=["accuracy"])
    acc.include.add(phase=pb.TEST)
    return net


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", required=True, help="bottleneck blocks per stage, e.g. 3,4,6,3 (ResNet-50)")
    p.add_argument("--batch", type=int, default=32, help="DummyData batch size (default 32)")
    p.add_argument("--out", help="prototxt to write (default: stdout)")
    args = p.parse_args(argv)
    return exit_status("make_resnet", lambda: _write(args))


def _write(args: argparse.Namespace) -> None:
    """Write (or print) the prototxt the flags describe, and say its depth."""
    blocks = parse_blocks(args.blocks)
    net = make_resnet(blocks, args.batch)
    depth = depth_of(blocks)
    text = (f"# Generated by tools/models/make_resnet.py --blocks {','.join(map(str, blocks))} --batch {args.batch}\n"
            f"# depth = 3 * ({' + '.join(map(str, blocks))}) + 2 = {depth}\n" + text_format.MessageToString(net))
    line = f"ResNet-{depth}: depth = 3 * {sum(blocks)} blocks + 2 = {depth} layers, batch {args.batch}"
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as e:
            raise UserError(f"{args.out}: cannot write it ({e.strerror or e})") from None
        print(f"{line} -> {args.out}")
    else:
        sys.stdout.write(text)
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
