"""Why the GPU determinism checks measure a blob against its layer's largest value (tests/test_parallel_gpu.py,
tools/gpu/determinism.py): the bias of a convolution that feeds BatchNorm has a gradient that is zero in exact
arithmetic (BatchNorm subtracts each channel's batch mean, so a per-channel constant changes nothing), so the
bias holds only rounding noise, and two GPU runs whose convolution sums in another order differ by 100% of it.
Here on the CPU: that gradient is rounding noise beside the weights' gradient, and without BatchNorm it is not."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons.backend.cpu import CpuBackend
from superneurons.graph.build import build_graph
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

NET = """name: "t"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 4.99 }
    shape { dim: 8 dim: 3 dim: 8 dim: 8 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
%s
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""
BATCH_NORM = 'layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }'


def _conv_gradients(between: str) -> tuple[np.ndarray, np.ndarray]:
    graph = build_graph(text_format.Parse(NET % between, pb.NetParameter()), pb.TRAIN)
    net = Net(graph, CpuBackend(), train=True, seed=3, memory="baseline")
    net.clear_param_diffs()
    net.forward_backward()
    weight, bias = net.layer("conv1").params
    return net.backend.to_host(weight.diff), net.backend.to_host(bias.diff)


@pytest.mark.parametrize("batch_norm", [True, False])
def test_a_convolution_bias_ahead_of_batch_norm_learns_only_rounding_noise(batch_norm):
    weight, bias = _conv_gradients(BATCH_NORM if batch_norm else "")
    ratio = np.abs(bias).max() / np.abs(weight).max()
    if batch_norm:
        assert ratio < 1e-5, ratio  # float32 rounding of sums over 8 x 8 x 8 values
    else:
        assert ratio > 1e-2, ratio
