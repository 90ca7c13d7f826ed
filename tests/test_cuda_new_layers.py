"""The GPU twins of the ops and layers added for Caffe's remaining types (LSTMUnit, Im2col, SPP, Parameter,
BatchReindex, RNN and LSTM unrolled) against the CPU backend on fresh random inputs. Needs an NVIDIA GPU
(`make gpu-test`); tests/test_recurrent_kernels_sim.py checks the kernels' index math without one."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import GPU_ONLY, assert_param_grads_match, close, one_iteration_on_both, randn, run_both

from superneurons.backend.geometry import ConvGeometry

pytestmark = GPU_ONLY


@pytest.mark.parametrize("n,hidden", [(3, 5), (64, 256)])
def test_lstm_unit(gpu, rng, n, hidden):
    c_prev, x = randn(rng, 1, n, hidden), 2 * randn(rng, 1, n, 4 * hidden)
    cont = (rng.random((1, n)) < 0.7).astype(np.float32)
    c, h = np.zeros((1, n, hidden), np.float32), np.zeros((1, n, hidden), np.float32)
    want, got = run_both(gpu, "lstm_unit_forward", [c_prev, x, cont, c, h])
    close(got[3], want[3])
    close(got[4], want[4])
    dc, dh = randn(rng, 1, n, hidden), randn(rng, 1, n, hidden)
    want, got = run_both(gpu, "lstm_unit_backward", [c_prev, x, cont, dc, dh, np.zeros_like(c_prev), np.zeros_like(x)])
    close(got[5], want[5])
    close(got[6], want[6])


@pytest.mark.parametrize("geom,hw", [(ConvGeometry((3, 3), (1, 1), (1, 1)), (9, 11)),
                                     (ConvGeometry((5, 3), (2, 3), (2, 0), (1, 2)), (17, 13))])
def test_im2col(gpu, rng, geom, hw):
    x = randn(rng, 2, 3, *hw)
    oh, ow = geom.out_size(hw)
    col = np.zeros((2, 3 * geom.kernel[0] * geom.kernel[1], oh, ow), np.float32)
    want, got = run_both(gpu, "im2col_forward", [x, col], geom)
    close(got[1], want[1], rtol=0, atol_scale=0)
    want, got = run_both(gpu, "im2col_backward", [randn(rng, *col.shape), np.zeros_like(x)], geom)
    close(got[1], want[1])


GAUSSIAN = "data_filler { type: 'gaussian' std: 1 }"
W = "weight_filler { type: 'gaussian' std: 0.2 } bias_filler { type: 'constant' value: 0.1 }"
NETS = {
    "spp_im2col": f"""
        layer {{ name: 'x' type: 'DummyData' top: 'x' top: 'label'
                dummy_data_param {{ shape {{ dim: 4 dim: 3 dim: 13 dim: 11 }} shape {{ dim: 4 }} {GAUSSIAN}
                                   data_filler {{ type: 'constant' value: 1 }} }} }}
        layer {{ name: 'conv' type: 'Convolution' bottom: 'x' top: 'conv'
                convolution_param {{ num_output: 4 kernel_size: 3 {W} }} }}
        layer {{ name: 'col' type: 'Im2col' bottom: 'conv' top: 'col'
                convolution_param {{ kernel_size: 2 stride: 2 }} }}
        layer {{ name: 'spp' type: 'SPP' bottom: 'col' top: 'spp' spp_param {{ pyramid_height: 2 }} }}
        layer {{ name: 'spp_ave' type: 'SPP' bottom: 'conv' top: 'spp_ave'
                spp_param {{ pyramid_height: 3 pool: AVE }} }}
        layer {{ name: 'join' type: 'Concat' bottom: 'spp' bottom: 'spp_ave' top: 'join' }}
        layer {{ name: 'fc' type: 'InnerProduct' bottom: 'join' top: 'fc' inner_product_param {{ num_output: 3 {W} }} }}
        layer {{ name: 'loss' type: 'SoftmaxWithLoss' bottom: 'fc' bottom: 'label' top: 'loss' }}""",
    "parameter_reindex": f"""
        layer {{ name: 'x' type: 'DummyData' top: 'x' top: 'idx'
                dummy_data_param {{ shape {{ dim: 5 dim: 6 }} shape {{ dim: 7 }} {GAUSSIAN}
                                   data_filler {{ type: 'constant' value: 3 }} }} }}
        layer {{ name: 'p' type: 'Parameter' top: 'p' parameter_param {{ shape {{ dim: 5 dim: 6 }} }} }}
        layer {{ name: 'sum' type: 'Eltwise' bottom: 'x' bottom: 'p' top: 'sum' }}
        layer {{ name: 'pick' type: 'BatchReindex' bottom: 'sum' bottom: 'idx' top: 'pick' }}
        layer {{ name: 'fc' type: 'InnerProduct' bottom: 'pick' top: 'fc' inner_product_param {{ num_output: 2 {W} }} }}
        layer {{ name: 't' type: 'DummyData' top: 'fc_target' dummy_data_param {{ shape {{ dim: 7 dim: 2 }} }} }}
        layer {{ name: 'loss' type: 'EuclideanLoss' bottom: 'fc' bottom: 'fc_target' top: 'loss' }}""",
}
for kind in ("LSTM", "RNN"):
    NETS[kind] = f"""
        layer {{ name: 'x' type: 'DummyData' top: 'x' top: 'cont' top: 'xs' top: 'label'
                dummy_data_param {{ shape {{ dim: 12 dim: 8 dim: 5 }} shape {{ dim: 12 dim: 8 }}
                                   shape {{ dim: 8 dim: 3 }}
                                   shape {{ dim: 12 dim: 8 }} {GAUSSIAN} data_filler {{ type: 'constant' value: 1 }}
                                   {GAUSSIAN} data_filler {{ type: 'constant' value: 2 }} }} }}
        layer {{ name: 'rec' type: '{kind}' bottom: 'x' bottom: 'cont' bottom: 'xs' top: 'h'
                recurrent_param {{ num_output: 16 {W} }} }}
        layer {{ name: 'fc' type: 'InnerProduct' bottom: 'h' top: 'fc'
                inner_product_param {{ num_output: 3 axis: 2 {W} }} }}
        layer {{ name: 'loss' type: 'SoftmaxWithLoss' bottom: 'fc' bottom: 'label' top: 'loss'
                softmax_param {{ axis: 2 }} }}"""


@pytest.mark.parametrize("name", sorted(NETS))
def test_net_forward_backward_matches_cpu(gpu, name):
    nets, losses = one_iteration_on_both(gpu, "force_backward: true " + NETS[name])
    assert_param_grads_match(nets, losses, name)
