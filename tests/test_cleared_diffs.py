"""A convolution overwrites a weight gradient the solver has just cleared (cuDNN's beta = 0 engines, faster
than adding into zeros) and adds into one that already holds a contribution: a layer sharing the weights,
the next pass of iter_size. On the CPU both give the same bits, so training is checked for the flags each
call received, and the op for overwriting garbage exactly."""
from __future__ import annotations

import numpy as np
import pytest
from test_solver import Quiet, solver_param

from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cpu.conv import conv_backward
from superneurons.backend.geometry import ConvGeometry
from superneurons.solver import Solver

SHARED_CONVS = """
name: "shared"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 }
    shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 2 } } }
layer { name: "split" type: "Split" bottom: "data" top: "a" top: "b" }
layer { name: "conv_a" type: "Convolution" bottom: "a" top: "ca" param { name: "w" }
  convolution_param { num_output: 4 kernel_size: 3 bias_term: false weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conv_b" type: "Convolution" bottom: "b" top: "cb" param { name: "w" }
  convolution_param { num_output: 4 kernel_size: 3 bias_term: false weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conv_c" type: "Convolution" bottom: "ca" top: "cc"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "sum" type: "Eltwise" bottom: "cc" bottom: "cb" top: "s" }
layer { name: "ip" type: "InnerProduct" bottom: "s" top: "ip" inner_product_param { num_output: 3
  weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_overwriting_dw_equals_adding_into_zeros():
    rng = np.random.default_rng()
    geom = ConvGeometry((3, 3), (1, 1), (1, 1))
    x, w, dy = rng.standard_normal((2, 3, 7, 7)), rng.standard_normal((5, 3, 3, 3)), rng.standard_normal((2, 5, 7, 7))
    added = np.zeros_like(w)
    conv_backward(x, w, dy, None, added, None, geom)
    overwritten = rng.standard_normal(w.shape)  # garbage that must not count
    conv_backward(x, w, dy, None, overwritten, None, geom, overwrite_dw=True)
    assert overwritten.tobytes() == added.tobytes()


@pytest.mark.parametrize("iter_size", [1, 2])
def test_only_the_first_write_after_clearing_overwrites(monkeypatch, iter_size):
    calls: list[tuple[tuple, bool]] = []
    ops = CpuBackend().ops
    real = ops.conv_backward

    def spy(x, w, dy, dx, dw, db, geom, accumulate_dx=False, overwrite_dw=False, **options):
        calls.append((w.shape, overwrite_dw))
        real(x, w, dy, dx, dw, db, geom, accumulate_dx=accumulate_dx, overwrite_dw=overwrite_dw, **options)

    text = f'type: "SGD" base_lr: 0.1 momentum: 0.9 max_iter: 2 iter_size: {iter_size} snapshot_after_train: false'
    solver = Solver(solver_param(text, net=SHARED_CONVS), "s.prototxt", log=Quiet())
    monkeypatch.setattr(solver.net.ops, "conv_backward", spy)
    solver.solve()
    # Per backward pass: conv_c's dw, and the first write of the shared "w" (conv_a's and conv_b's), are
    # overwritten on the first pass after the solver cleared them; every other write adds.
    passes = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(passes) == 2 * iter_size
    for k, one_pass in enumerate(passes):
        first_pass = k % iter_size == 0
        assert [flag for shape, flag in one_pass if shape == (4, 4, 1, 1)] == [first_pass]
        assert [flag for shape, flag in one_pass if shape == (4, 3, 3, 3)] == [first_pass, False]


def test_shared_and_accumulated_weights_train_as_before(monkeypatch):
    """The solver's weights with the overwrite (default) and with every write adding (the claim disabled)."""
    import superneurons.layers.base as layer_base  # where a layer claims its parameters' cleared gradients

    def train():
        text = 'type: "SGD" base_lr: 0.1 momentum: 0.9 max_iter: 3 iter_size: 2 snapshot_after_train: false'
        solver = Solver(solver_param(text, net=SHARED_CONVS), "s.prototxt", log=Quiet())
        solver.solve()
        return [t.array.tobytes() for t in solver.net.tensors if t.kind == "param"]

    with_claims = train()
    monkeypatch.setattr(layer_base, "claim_cleared_diff", lambda decl: False)
    assert train() == with_claims
