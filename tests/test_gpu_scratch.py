"""On the GPU, every device byte a training run uses after its first iterations is pool memory the plan counts:
the ops' float64 sums come from the net's `#scratch` region (backend/scratch.py), convolutions borrow their
workspace from the pool (memory/workspace.py), and in a half net the loss computes on planned float32 copies of
its half bottom (Layer.use_float32_copies), so numba allocates no device array in the loop and no op runs on
backend/cuda/half_math.py's copies.

The first test leaves the first iterations out (the test net is built, its pool, at the first test pass); the
last one counts from the first iteration, where cuDNN measures each convolution direction, into an output
borrowed from the pool for the directions that accumulate (backend/cuda/cudnn.py), where Crop and the grouped
update run too.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from gpu_harness import GPU_ONLY
from test_solver import Quiet, solver_param
from superneurons.backend.cuda import half_math
from superneurons.solver import Solver

pytestmark = GPU_ONLY

W = 'weight_filler { type: "gaussian" std: 0.05 } bias_filler { type: "constant" value: 0.1 }'
# A convolution whose bias gradient runs our per-channel sum (32 x 32 planes), a fused BatchNorm + Scale + ReLU
# (several blocks per channel), an InnerProduct with a bias, the loss and, in the test net, Accuracy: every kind
# of op that sums into the region.
NET = f"""
name: "sums"
layer {{ name: "data" type: "DummyData" top: "x" top: "label"
  dummy_data_param {{ data_filler {{ type: "gaussian" std: 1 }} data_filler {{ type: "constant" value: 3 }}
    shape {{ dim: 8 dim: 3 dim: 32 dim: 32 }} shape {{ dim: 8 }} }} }}
layer {{ name: "conv" type: "Convolution" bottom: "x" top: "conv"
  convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {W} }} }}
layer {{ name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }}
layer {{ name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param {{ bias_term: true }} }}
layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param {{ num_output: 10 {W} }} }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


def count_device_arrays(monkeypatch) -> list:
    """The list every later numba device allocation (device_array, device_array_like, to_device) appends to."""
    calls: list = []
    real = cuda.device_array

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    for name in ("device_array", "device_array_like", "to_device"):
        monkeypatch.setattr(cuda, name, counted)
    return calls


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_device_array_is_allocated_after_the_first_iterations(gpu, monkeypatch, precision):
    text = ("base_lr: 0.01 momentum: 0.9 max_iter: 5 clip_gradients: 100 debug_info: true test_iter: 1 "
            "test_interval: 2 test_initialization: false snapshot_after_train: false")
    solver = Solver(solver_param(text, net=NET), "s.prototxt", backend=gpu, log=Quiet(), precision=precision)
    solver.step(3)  # iterations 0-2 and the first test pass: the test net is built, cuDNN's plans measured
    net = solver.net
    region = net.ctx.scratch
    assert net.pool.owns(net.layout.scratch) and region.dtype == np.float64
    assert region.size == max(2 * 16, 2 * 10, 5)  # the bias and BatchNorm sums of 16 channels lead
    arena = net.backend.address(net.pool.arena)
    assert arena <= net.backend.address(region) < arena + net.pool.capacity  # pool memory
    calls = count_device_arrays(monkeypatch)
    on_copies = []
    real_copies = half_math.on_float32_copies
    monkeypatch.setattr(half_math, "on_float32_copies", lambda fn, *a: (on_copies.append(fn.__name__),
                                                                         real_copies(fn, *a))[1])
    solver.step(2)  # iterations 3 and 4, with the second test pass
    cuda.synchronize()
    assert calls == [] and on_copies == []
    assert np.isfinite(net.backend.to_host(net.data["loss"].array)).all()


# Two convolutions reading one blob (the second adds its data gradient into the first's: a direction that
# accumulates), two passes per iteration (the filter gradients accumulate too), a deconvolution cropped back to
# that blob's size, and the grouped SGD update.
FAN_CROP_NET = f"""
name: "fan_crop"
layer {{ name: "data" type: "DummyData" top: "x" top: "label"
  dummy_data_param {{ data_filler {{ type: "gaussian" std: 1 }} data_filler {{ type: "constant" value: 3 }}
    shape {{ dim: 8 dim: 3 dim: 16 dim: 16 }} shape {{ dim: 8 }} }} }}
layer {{ name: "c0" type: "Convolution" bottom: "x" top: "c0" convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {W} }} }}
layer {{ name: "ca" type: "Convolution" bottom: "c0" top: "ca" convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {W} }} }}
layer {{ name: "cb" type: "Convolution" bottom: "c0" top: "cb" convolution_param {{ num_output: 16 kernel_size: 1 {W} }} }}
layer {{ name: "sum" type: "Eltwise" bottom: "ca" bottom: "cb" top: "sum" }}
layer {{ name: "up" type: "Deconvolution" bottom: "sum" top: "up"
  convolution_param {{ num_output: 8 kernel_size: 4 stride: 2 {W} }} }}
layer {{ name: "crop" type: "Crop" bottom: "up" bottom: "c0" top: "crop" crop_param {{ axis: 2 offset: 1 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "crop" top: "ip" inner_product_param {{ num_output: 10 {W} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


@pytest.mark.parametrize("memory", ["baseline", "liveness"])
def test_from_the_first_iteration_every_device_byte_is_the_pools(gpu, monkeypatch, memory):
    """Crop's geometry travels in the kernel's arguments, the grouped update's tables are the planned `#update`
    tensor, and cuDNN's first measuring of a direction that accumulates borrows its output from the pool: from the
    first iteration on numba allocates nothing beside the pool (the test net, which has a pool of its own, is off)."""
    from superneurons.backend.cuda.cudnn import measures_algorithms
    from superneurons.backend.cuda.device import current

    # cuDNN's plans are kept per shape for the process: an empty cache, so this net measures its own (the
    # parameter run before it built the same shapes)
    monkeypatch.setattr(current().cudnn, "_convs", {})
    text = "base_lr: 0.01 momentum: 0.9 max_iter: 3 iter_size: 2 snapshot_after_train: false"
    solver = Solver(solver_param(text, net=FAN_CROP_NET), "s.prototxt", backend=gpu, log=Quiet(), memory=memory)
    net = solver.net
    arena = net.backend.address(net.pool.arena)
    table = net.update_table
    assert solver._grouped is not None and net.pool.owns(table.key)
    assert arena <= net.backend.address(table.array) < arena + net.pool.capacity
    calls = count_device_arrays(monkeypatch)
    solver.step(3)
    cuda.synchronize()
    assert calls == []
    if measures_algorithms():
        # the largest output measured into: c0's summed data gradient (8 x 16 x 16 x 16 float32)
        assert net.ctx.workspace.measure_bytes >= 8 * 16 * 16 * 16 * 4
    assert not net.pool.owns("#measure")  # given back after the call
    assert np.isfinite(net.backend.to_host(net.data["loss"].array)).all()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_channels_last_nets_conversions_come_from_its_steps_rooms(gpu, monkeypatch, precision):
    """With NHWC blobs the first convolution converts the data layer's NCHW batch and the InnerProduct's input
    comes from an NHWC blob: those copies are views of the steps' planned rooms (Layer.use_layout_copies), so
    from the first iteration on numba allocates nothing beside the pool."""
    from superneurons.backend.cuda import layout_conversion

    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    text = "base_lr: 0.01 momentum: 0.9 max_iter: 3 snapshot_after_train: false"
    pooled = NET.replace('layer { name: "ip" type: "InnerProduct" bottom: "conv"',
                         'layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX '
                         'kernel_size: 2 stride: 2 } }\nlayer { name: "ip" type: "InnerProduct" bottom: "pool"')
    assert "Pooling" in pooled
    solver = Solver(solver_param(text, net=pooled), "s.prototxt", backend=gpu, log=Quiet(), precision=precision,
                    memory="liveness")
    net = solver.net
    assert net.blob_layouts.any and net.layer("conv").layout_copies("forward") is not None
    calls = count_device_arrays(monkeypatch)
    before = sum(layout_conversion.conversions().values())
    solver.step(3)
    cuda.synchronize()
    assert sum(layout_conversion.conversions().values()) > before  # it converted, and
    assert calls == []  # every copy was pool memory
    assert np.isfinite(net.backend.to_host(net.data["loss"].array)).all()
