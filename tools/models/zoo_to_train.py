#!/usr/bin/env python
"""Turn model-zoo deploy prototxts into ready-to-train nets fed by DummyData.

    python tools/models/zoo_to_train.py path/to/zoo                  # (re)writes models/<name>/ for every known net
    python tools/models/zoo_to_train.py path/to/zoo --only vgg16,alexnet --batch 8
    python tools/models/zoo_to_train.py --deploy D.prototxt --out T.prototxt --batch 16 [--side 224] [--classes 1000]

What a conversion does to the deploy net:
  * its Input layer (or the old `input:`/`input_dim:` fields) becomes a DummyData layer named "data" with two
    tops: `data` (N x C x H x W, gaussian std 1) and `label` (N, constant `--label`, an integer class index:
    Caffe's uniform filler would give non-integer labels);
  * a final Softmax whose output nothing reads (the deploy's "prob") is dropped;
  * BatchNorm layers lose `use_global_stats`, so TRAIN normalises with batch statistics and TEST with the
    running ones (Caffe's default for each phase);
  * Convolution and InnerProduct layers without a weight_filler (deploy nets usually have none, and Caffe's
    default is constant 0, which would train nothing) get an "msra" one; biases keep the default constant 0;
  * SoftmaxWithLoss (both phases) and Accuracy (TEST) are appended on the net's one remaining output.
Beside each net the script writes `<name>_dummy_solver.prototxt` (SGD, momentum 0.9, base_lr 0.01, 20 iterations).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from superneurons.errors import UserError, exit_status
from superneurons.io.prototxt import read_net
from superneurons.proto import superneurons_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Spec:
    deploy: str  # relative to the zoo folder
    batch: int
    side: int  # input height = width
    classes: int = 1000


# The nets of models/; the image side is the one each deploy prototxt declares.
SPECS: dict[str, Spec] = {
    "cifar10_quick": Spec("caffe/examples/cifar10/cifar10_quick.prototxt", 100, 32, 10),
    "alexnet": Spec("caffe/models/bvlc_alexnet/deploy.prototxt", 128, 227),
    "vgg16": Spec("vgg/deploy_vgg16-pytorch.prototxt", 32, 224),
    "resnet101": Spec("resnet/ResNet-101-deploy.prototxt", 32, 224),
    "resnet152": Spec("resnet/ResNet-152-deploy.prototxt", 32, 224),
    "inception_v4": Spec("inception/deploy_inception-v4.prototxt", 32, 299),
    "densenet121": Spec("densenet/DenseNet_121.prototxt", 32, 224),
    "squeezenet": Spec("squeezenet/SqueezeNet_v1.0/deploy.prototxt", 64, 227),
    "mobilenet": Spec("mobilenet/mobilenet_deploy.prototxt", 64, 224),
}


def _input_layer(net: pb.NetParameter, where: str) -> int:
    found = [i for i, lp in enumerate(net.layer) if lp.type == "Input"]
    if len(found) != 1:
        raise UserError(f"{where}: expected exactly one Input layer (or input: field) to replace, found {len(found)}")
    lp = net.layer[found[0]]
    shapes = list(lp.input_param.shape)
    if len(lp.top) != 1 or len(shapes) != 1 or len(shapes[0].dim) != 4:
        raise UserError(f"{where}: Input layer {lp.name!r} must have one top of shape N x C x H x W, "
                        f"has {len(lp.top)} top(s) and shape(s) {[list(s.dim) for s in shapes]}")
    return found[0]


def _drop_final_softmax(net: pb.NetParameter) -> None:
    consumed = {b for lp in net.layer for b in lp.bottom}
    keep = [lp for lp in net.layer if not (lp.type == "Softmax" and list(lp.top) != list(lp.bottom)
                                           and all(t not in consumed for t in lp.top))]
    if len(keep) != len(net.layer):
        del net.layer[:]
        net.layer.extend(keep)


def _outputs(net: pb.NetParameter) -> list[str]:
    consumed = {b for lp in net.layer for b in lp.bottom}
    out: list[str] = []
    for lp in net.layer:
        for t in lp.top:
            if t not in consumed and t not in out:
                out.append(t)
    return out


def convert(net: pb.NetParameter, *, batch: int, side: int | None = None, classes: int | None = None,
            label: int = 1, where: str = "<net>") -> pb.NetParameter:
    """A training copy of the deploy `net` (see the module docstring). `side=None` keeps the deploy's H x W."""
    if batch <= 0:
        raise UserError(f"{where}: batch must be positive, got {batch}")
    out = pb.NetParameter()
    out.CopyFrom(net)
    i = _input_layer(out, where)
    old = out.layer[i]
    data_top = old.top[0]
    _, channels, height, width = (int(d) for d in old.input_param.shape[0].dim)
    if side is not None:
        height = width = side
    if any(t == "label" for lp in out.layer for t in lp.top):
        raise UserError(f"{where}: the net already has a blob named 'label'")

    dummy = pb.LayerParameter(name=old.name or "data", type="DummyData", top=[data_top, "label"])
    dp = dummy.dummy_data_param
    dp.shape.add().dim.extend([batch, channels, height, width])
    dp.shape.add().dim.extend([batch])
    dp.data_filler.add(type="gaussian", std=1.0)
    dp.data_filler.add(type="constant", value=float(label))
    out.layer[i].CopyFrom(dummy)

    _drop_final_softmax(out)
    for lp in out.layer:
        if lp.type == "BatchNorm" and lp.HasField("batch_norm_param"):
            lp.batch_norm_param.ClearField("use_global_stats")
            if not lp.batch_norm_param.ListFields():
                lp.ClearField("batch_norm_param")

    for lp in out.layer:
        for kind, field in (("Convolution", "convolution_param"), ("InnerProduct", "inner_product_param")):
            if lp.type == kind and not getattr(lp, field).HasField("weight_filler"):
                getattr(lp, field).weight_filler.type = "msra"

    outputs = [t for t in _outputs(out) if t != "label"]
    if len(outputs) != 1:
        raise UserError(f"{where}: expected one output blob (the class scores) after dropping the final Softmax, "
                        f"found {len(outputs)}: {', '.join(outputs) or 'none'}")
    scores = outputs[0]
    if classes is not None and not 0 <= label < classes:
        raise UserError(f"{where}: label {label} is not a class index of a {classes}-class net")
    out.layer.add(name="loss", type="SoftmaxWithLoss", bottom=[scores, "label"], top=["loss"])
    acc = out.layer.add(name="accuracy", type="Accuracy", bottom=[scores, "label"], top=["accuracy"])
    acc.include.add(phase=pb.TEST)
    return out


def solver_text(name: str, net_path: str) -> str:
    return f"""# Generated by tools/models/zoo_to_train.py: {name} on DummyData, a short benchmark/smoke-test run.
net: "{net_path}"
type: "SGD"
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "fixed"
max_iter: 20
display: 1
# One TEST batch (loss and accuracy) at iteration 20; none before training starts.
test_iter: 1
test_interval: 20
test_initialization: false
# No snapshots: the weights of a run on random data are not worth the disk.
snapshot: 0
snapshot_after_train: false
snapshot_prefix: "snapshots/{name}_dummy"
solver_mode: GPU
random_seed: 1701
"""


def net_text(net: pb.NetParameter, source: str) -> str:
    return (f"# Generated by tools/models/zoo_to_train.py from the model zoo's {source}:\n"
            "# DummyData input, the deploy's final Softmax dropped, msra fillers where the deploy gave none,\n"
            "# BatchNorm use_global_stats removed, SoftmaxWithLoss + Accuracy (TEST) appended.\n"
            + text_format.MessageToString(net))


def write_model(zoo: Path, name: str, spec: Spec, out_dir: Path, batch: int | None, label: int) -> list[Path]:
    deploy = zoo / spec.deploy
    if not deploy.is_file():
        raise UserError(f"{deploy}: no such deploy prototxt (is {zoo} the model zoo?)")
    net = convert(read_net(str(deploy)), batch=batch or spec.batch, side=spec.side, classes=spec.classes,
                  label=label, where=str(deploy))
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    net_path = folder / f"{name}_dummy.prototxt"
    solver_path = folder / f"{name}_dummy_solver.prototxt"
    net_path.write_text(net_text(net, spec.deploy))
    try:
        rel = net_path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        rel = str(net_path)
    solver_path.write_text(solver_text(name, rel))
    return [net_path, solver_path]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("zoo", nargs="?", help="the model zoo folder (holding caffe/models/..., as $SUPERNEURONS_ZOO for the tests)")
    p.add_argument("--out-dir", default=str(ROOT / "models"), help="where models/<name>/ go (default: %(default)s)")
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(SPECS)}")
    p.add_argument("--batch", type=int, help="batch size (default: each net's own, see SPECS)")
    p.add_argument("--label", type=int, default=1, help="the constant class index of every label (default 1)")
    p.add_argument("--deploy", help="convert this one deploy prototxt instead (needs --out)")
    p.add_argument("--out", help="with --deploy: the training prototxt to write")
    p.add_argument("--side", type=int, help="with --deploy: input height and width (default: the deploy's)")
    args = p.parse_args(argv)
    return exit_status("zoo_to_train", lambda: _convert(args))


def _convert(args: argparse.Namespace) -> None:
    """Convert the one --deploy file, or every zoo net (--only: some) into models/<name>/."""
    if args.deploy:
        if not args.out:
            raise UserError("--deploy needs --out FILE")
        net = convert(read_net(args.deploy), batch=args.batch or 1, side=args.side, label=args.label,
                      where=args.deploy)
        Path(args.out).write_text(net_text(net, os.path.basename(args.deploy)))
        print(f"wrote {args.out}")
        return
    if not args.zoo:
        raise UserError("give the model zoo folder (holding caffe/models/...) or --deploy FILE --out FILE")
    zoo = Path(args.zoo)
    if not zoo.is_dir():
        raise UserError(f"{zoo}: not a folder")
    names = [n.strip() for n in args.only.split(",")] if args.only else list(SPECS)
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        raise UserError(f"--only: unknown net(s) {', '.join(unknown)}; known: {', '.join(SPECS)}")
    for name in names:
        for path in write_model(zoo, name, SPECS[name], Path(args.out_dir), args.batch, args.label):
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
