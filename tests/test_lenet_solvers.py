"""Each solver type trains the real LeNet on the embedded digits, with Caffe's MNIST-example settings."""
from pathlib import Path

import numpy as np
import pytest
from harness import load_tool
from google.protobuf import text_format

from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.logging import TrainLog
from superneurons.solver.solver import Solver

ROOT = Path(__file__).resolve().parents[1]
LENET = ROOT / "models" / "lenet" / "lenet_train_test.prototxt"

# The update settings of Caffe's examples/mnist/lenet_solver*.prototxt for each type.
SETTINGS = {
    "SGD": 'base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75',
    "Nesterov": 'base_lr: 0.01 momentum: 0.95 weight_decay: 0.0005 lr_policy: "fixed"',
    "AdaGrad": 'base_lr: 0.01 weight_decay: 0.0005 lr_policy: "fixed"',
    "RMSProp": 'base_lr: 0.01 momentum: 0.0 weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75 '
               'rms_decay: 0.98',
    "AdaDelta": 'base_lr: 1.0 momentum: 0.95 weight_decay: 0.0005 lr_policy: "fixed" delta: 1e-6',
    "Adam": 'base_lr: 0.001 momentum: 0.9 momentum2: 0.999 lr_policy: "fixed"',
}


@pytest.fixture(scope="module")
def digits_workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("lenet")
    load_tool("data/make_digits_lmdb").main(["--out", str(work / "data" / "digits")])
    return work


@pytest.mark.parametrize("kind", sorted(SETTINGS))
def test_solver_type_trains_lenet_on_digits(kind, digits_workdir, monkeypatch):
    monkeypatch.chdir(digits_workdir)  # the net's LMDB sources are relative to the working directory
    param = text_format.Parse(
        f'net: "{LENET}" type: "{kind}" {SETTINGS[kind]} max_iter: 40 display: 0 test_iter: 1 '
        f'test_interval: 1000 test_initialization: false snapshot_after_train: false random_seed: 7',
        pb.SolverParameter())
    solver = Solver(param, str(digits_workdir / "solver.prototxt"), log=TrainLog())
    losses = []
    solver.callbacks.append(lambda s, it, loss: losses.append(loss))
    solver.solve()
    assert len(losses) == 40
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert np.isfinite(losses).all()
    assert last < 0.6 * first, f"{kind}: loss went from {first:.3f} to {last:.3f}"
