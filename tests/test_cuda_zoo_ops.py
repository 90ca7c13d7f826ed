"""The GPU twins of the zoo ops against the CPU backend on realistic shapes, forward and backward, and whole
nets using every zoo layer on both backends. Run with `make gpu-test` on a GPU machine; skipped elsewhere.

Tolerances (float32): elementwise ops rtol 1e-5 (float32 rounding; the GPU's expf/logf/powf are within
a few ulp of NumPy's); ops that sum (reductions, MVN, PReLU's slope, Tile's backward, Embed's scatter, the
losses) accumulate in float64 on the GPU and in float32 pairwise on the CPU: rtol 1e-4, atol 1e-5 of the
output's scale. Copies (Crop, Tile forward, ArgMax) and the random fill's integer hash are compared
exactly or to float32 rounding. Depthwise convolution runs cuDNN with FMA math (tf32=False), rtol 1e-4.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from superneurons.backend.geometry import ConvGeometry
from gpu_harness import (FLOAT32_VALUES, CPU, GPU_ONLY, assert_param_grads_match, close, dev, dummy_images, f32,
                         one_iteration_on_both, randn, run_both)

pytestmark = GPU_ONLY


SHAPE = (32, 64, 28, 28)
def test_threshold(gpu, rng):
    x = randn(rng, *SHAPE)
    (_, yc), (_, yg) = run_both(gpu, "threshold_forward", [x, np.zeros_like(x)], 0.3)
    assert np.array_equal(yg, yc)


@pytest.mark.parametrize("shared", [False, True])
def test_prelu(gpu, rng, shared):
    outer, ch, inner = SHAPE[0], SHAPE[1], SHAPE[2] * SHAPE[3]
    x = randn(rng, *SHAPE)
    slope = randn(rng, 1 if shared else ch) * f32(0.3)
    (*_, yc), (*_, yg) = run_both(gpu, "prelu_forward", [x, slope, np.zeros_like(x)], outer, ch, inner)
    close(yg, yc)
    dy = randn(rng, *SHAPE)
    (*_, dxc, dsc), (*_, dxg, dsg) = run_both(gpu, "prelu_backward", [x, slope, dy, np.zeros_like(x),
                                                                       randn(rng, *slope.shape)], outer, ch, inner)
    close(dxg, dxc)
    close(dsg, dsc, rtol=1e-4)


def test_crop_and_tile(gpu, rng):
    x = randn(rng, 16, 21, 64, 64)
    y = np.zeros((16, 21, 50, 48), f32)
    offsets = (0, 0, 7, 9)
    (_, yc), (_, yg) = run_both(gpu, "crop_forward", [x, y], offsets)
    assert np.array_equal(yg, yc)
    (_, dxc), (_, dxg) = run_both(gpu, "crop_backward", [randn(rng, *y.shape), randn(rng, *x.shape)], offsets)
    assert np.array_equal(dxg, dxc)
    outer, tiles, inner = 32, 5, 64 * 7 * 7
    x = randn(rng, outer, inner)
    (_, tc), (_, tg) = run_both(gpu, "tile_forward", [x, np.zeros((outer, tiles * inner), f32)], outer, tiles, inner)
    assert np.array_equal(tg, tc)
    (_, dc), (_, dg) = run_both(gpu, "tile_backward", [randn(rng, *tc.shape), np.zeros_like(x)], outer, tiles, inner)
    close(dg, dc, rtol=1e-5)


@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("outer,inner", [(32 * 64, 49), (32, 64 * 28 * 28), (1, 1 << 20)])
def test_reduction(gpu, rng, op, outer, inner):
    x = randn(rng, outer, inner)
    (_, yc), (_, yg) = run_both(gpu, "reduction_forward", [x, np.zeros(outer, f32)], op, 0.5, outer, inner)
    close(yg, yc, rtol=1e-4)
    dy = randn(rng, outer)
    (*_, dxc), (*_, dxg) = run_both(gpu, "reduction_backward", [x, dy, np.zeros_like(x)], op, 0.5, outer, inner)
    close(dxg, dxc)


@FLOAT32_VALUES
@pytest.mark.parametrize("top_k,out_max_val", [(1, False), (5, True)])
def test_argmax(gpu, rng, top_k, out_max_val):
    x = randn(rng, 64, 1000, 1)
    width = 2 if out_max_val else 1
    (_, yc), (_, yg) = run_both(gpu, "argmax_forward", [x, np.zeros((64, width, top_k), f32)], top_k, out_max_val,
                                False)
    assert np.array_equal(yg, yc)
    x = np.round(randn(rng, 8, 21, 32 * 32) * 2)  # an axis ArgMax over segmentation scores, with ties
    (_, yc), (_, yg) = run_both(gpu, "argmax_forward", [x, np.zeros((8, top_k, 32 * 32), f32)], top_k, out_max_val,
                                True)
    assert np.array_equal(yg, yc)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("across", [False, True])
def test_mvn(gpu, rng, normalize, across):
    x = randn(rng, *SHAPE) * f32(2) + f32(0.5)
    rows = SHAPE[0] if across else SHAPE[0] * SHAPE[1]
    n = x.size // rows
    sigma = np.zeros(rows, f32) if normalize else None
    (_, yc, sc), (_, yg, sg) = run_both(gpu, "mvn_forward", [x, np.zeros_like(x), sigma], rows, n, 1e-9)
    close(yg, yc, rtol=1e-4, atol_scale=1e-4)
    dy = randn(rng, *SHAPE)
    (*_, dxc, _), (*_, dxg, _) = run_both(gpu, "mvn_backward", [yc if normalize else None, dy, np.zeros_like(x), sc],
                                          rows, n)
    close(dxg, dxc, rtol=1e-4, atol_scale=1e-4)


@FLOAT32_VALUES
def test_embed(gpu, rng):
    input_dim, num_output = 10000, 256
    idx = rng.integers(0, input_dim, (64, 35)).astype(f32)
    idx[0, :10] = 7  # repeated rows add up (atomics)
    w, b = randn(rng, input_dim, num_output), randn(rng, num_output)
    (*_, yc), (*_, yg) = run_both(gpu, "embed_forward", [idx, w, b, np.zeros((idx.size, num_output), f32)])
    assert np.array_equal(yg, yc)
    dy = randn(rng, idx.size, num_output)
    (_, _, dwc, dbc), (_, _, dwg, dbg) = run_both(gpu, "embed_backward", [idx, dy, np.zeros_like(w),
                                                                           np.zeros_like(b)])
    close(dwg, dwc, rtol=1e-4)
    close(dbg, dbc, rtol=1e-4)
    from superneurons.errors import UserError

    idx[3, 3] = input_dim
    with pytest.raises(UserError, match="not an integer"):
        gpu.ops.embed_forward(dev(gpu, idx), dev(gpu, w), None, dev(gpu, np.zeros((idx.size, num_output), f32)))


def loss_both(gpu, fwd, bwd, inputs, fwd_scalars, outputs, bwd_scalars, weight=1.7):
    (*_, lc), (*_, lg) = run_both(gpu, fwd, inputs + [np.zeros((), f32)], *fwd_scalars)
    close(lg, lc, rtol=1e-4)
    host, got = run_both(gpu, bwd, inputs + [np.array(weight, f32)] + outputs, *bwd_scalars)
    for g, h in zip(got[-len(outputs):], host[-len(outputs):]):
        close(g, h, rtol=1e-4)


def test_euclidean_and_contrastive(gpu, rng):
    a, b = randn(rng, 256, 128), randn(rng, 256, 128)
    loss_both(gpu, "euclidean_loss_forward", "euclidean_loss_backward", [a, b], (), [np.zeros_like(a)] * 2, ())
    a4, b4 = (v.reshape(256, 128, 1, 1) * f32(0.1) for v in (a, b))
    sim = rng.integers(0, 2, 256).astype(f32)
    for legacy in (False, True):
        loss_both(gpu, "contrastive_loss_forward", "contrastive_loss_backward", [a4, b4, sim], (1.5, legacy),
                  [np.zeros_like(a4)] * 2, (1.5, legacy))


@pytest.mark.parametrize("ignore,norm", [(None, "VALID"), (1, "VALID"), (1, "FULL"), (None, "BATCH_SIZE")])
def test_sigmoid_cross_entropy(gpu, rng, ignore, norm):
    x = randn(rng, 64, 21, 32, 32) * f32(3)
    t = (rng.random(x.shape) > 0.5).astype(f32)
    t[:8, :, :4] = 1.0
    loss_both(gpu, "sigmoid_ce_loss_forward", "sigmoid_ce_loss_backward", [x, t], (ignore, norm),
              [np.zeros_like(x)], (ignore, norm))


@FLOAT32_VALUES
@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_and_multinomial(gpu, rng, norm):
    x = randn(rng, 256, 1000)
    label = rng.integers(0, 1000, 256).astype(f32)
    loss_both(gpu, "hinge_loss_forward", "hinge_loss_backward", [x, label], (norm,), [np.zeros_like(x)], (norm,))
    prob = rng.random((256, 1000)).astype(f32)
    prob /= prob.sum(axis=1, keepdims=True)
    loss_both(gpu, "multinomial_logistic_loss_forward", "multinomial_logistic_loss_backward", [prob, label], (),
              [np.zeros_like(prob)], ())


@pytest.mark.parametrize("ignore,norm", [(None, "VALID"), (3, "VALID"), (3, "FULL")])
def test_infogain(gpu, rng, ignore, norm):
    outer, ch, inner = 8, 21, 32 * 32
    prob = rng.random((outer, ch, inner)).astype(f32) + f32(0.01)
    prob /= prob.sum(axis=1, keepdims=True)
    label = rng.integers(0, ch, (outer, inner)).astype(f32)
    h = rng.random((ch, ch)).astype(f32)
    loss_both(gpu, "infogain_loss_forward", "infogain_loss_backward", [prob, label, h], (ignore, norm),
              [np.zeros_like(prob)], (ignore, norm))


@pytest.mark.parametrize("kind,a,b,keep", [("uniform", -1.0, 2.0, 1.0), ("gaussian", 0.0, 1.0, 1.0),
                                           ("gaussian", 0.5, 2.0, 0.25)])
@FLOAT32_VALUES
def test_random_fill_matches_cpu(gpu, kind, a, b, keep):
    shape = (32, 3, 224, 224)  # a ResNet-50 batch
    (yc,), (yg,) = run_both(gpu, "random_fill", [np.zeros(shape, f32)], kind, a, b, keep, 1701, 9, 0, 0)
    close(yg, yc, rtol=1e-6, atol_scale=1e-6)  # same words and float64 formulas; libdevice vs NumPy last bits
    assert np.mean(yg == yc) > 0.99
    d = dev(gpu, np.zeros(shape, f32))
    gpu.ops.random_fill(d, kind, a, b, keep, 1701, 9, 0, 0)
    assert np.array_equal(gpu.to_host(d), yg)  # a pure function of (seed, iteration, layer, stream)
    gpu.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        gpu.ops.random_fill(d, kind, a, b, keep, 1701, 10, 0, 0)
    gpu.synchronize()
    print(f"random_fill {kind} {shape}: {(time.perf_counter() - start) * 100:.3f} ms per batch")


@pytest.mark.parametrize("n,c,hw,stride", [(32, 32, 112, 1), (32, 144, 56, 2), (32, 960, 7, 1)])
def test_depthwise_conv(gpu, rng, n, c, hw, stride):
    """group == channels (MobileNet-style) through cuDNN grouped convolution: matches the CPU; the time per
    forward + backward is printed (run with -s) to spot a pathological algorithm choice."""
    geom = ConvGeometry((3, 3), (stride, stride), (1, 1), (1, 1), c)
    oh = (hw + 2 - 3) // stride + 1
    x, w, b = randn(rng, n, c, hw, hw), randn(rng, c, 1, 3, 3) * f32(0.3), randn(rng, c)
    y = np.zeros((n, c, oh, oh), f32)
    (*_, yc), (*_, yg) = run_both(gpu, "conv_forward", [x, w, b, y], geom)
    dy = randn(rng, *y.shape)
    host = [x, w, dy, np.zeros_like(x), np.zeros_like(w), np.zeros_like(b)]
    CPU.ops.conv_backward(*host, geom)
    d = [dev(gpu, a) for a in (x, w, dy, np.zeros_like(x), np.zeros_like(w), np.zeros_like(b))]
    gpu.ops.conv_backward(*d, geom)
    import gpu_harness

    print(f"depthwise {c}x{hw}x{hw} s{stride}:",
          gpu.ops.conv_algorithm(x.shape, w.shape, y.shape, geom, gpu_harness.STORAGE))
    close(yg, yc, rtol=1e-4, atol_scale=1e-4)
    for i in (3, 4, 5):
        close(gpu.to_host(d[i]), host[i], rtol=1e-4, atol_scale=1e-4)
    dx_, dw_, db_ = d[3], d[4], d[5]
    dy_, dydev = d[2], dev(gpu, y)
    gpu.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        gpu.ops.conv_forward(d[0], d[1], None, dydev, geom)
        gpu.ops.conv_backward(d[0], d[1], dy_, dx_, dw_, db_, geom)
    gpu.synchronize()
    ms = (time.perf_counter() - start) * 100
    print(f"depthwise {n}x{c}x{hw}x{hw} s{stride}: {ms:.3f} ms fwd+bwd; "
          f"{gpu.ops.conv_algorithm(x.shape, w.shape, y.shape, geom, f32)}")


ZOO_NETS = {
    "neurons_and_shapes": 'name: "ZooA"\n' + dummy_images(8, 16, 12, 12) + """layer { name: "dw" type: "Convolution" bottom: "data" top: "dw"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 group: 16 weight_filler { type: "msra" } } }
layer { name: "prelu" type: "PReLU" bottom: "dw" top: "prelu" }
layer { name: "deconv" type: "Deconvolution" bottom: "prelu" top: "deconv"
  convolution_param { num_output: 8 kernel_size: 4 stride: 2 pad: 1 weight_filler { type: "xavier" } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "elu" type: "ELU" bottom: "deconv" top: "deconv" }
layer { name: "mvn" type: "MVN" bottom: "deconv" top: "mvn" }
layer { name: "crop" type: "Crop" bottom: "mvn" bottom: "data" top: "crop" crop_param { axis: 2 offset: 3 } }
layer { name: "slice" type: "Slice" bottom: "crop" top: "s1" top: "s2" slice_param { axis: 1 slice_point: 3 } }
layer { name: "abs" type: "AbsVal" bottom: "s1" top: "abs" }
layer { name: "bnll" type: "BNLL" bottom: "s2" top: "bnll" }
layer { name: "pow" type: "Power" bottom: "abs" top: "pow" power_param { power: 1.5 scale: 0.5 shift: 1 } }
layer { name: "log" type: "Log" bottom: "pow" top: "log" log_param { shift: 0.5 } }
layer { name: "exp" type: "Exp" bottom: "bnll" top: "exp" exp_param { scale: -0.5 } }
layer { name: "bias" type: "Bias" bottom: "exp" top: "bias" bias_param { axis: 1 num_axes: 1 filler { type: "gaussian" std: 0.5 } } }
layer { name: "tile" type: "Tile" bottom: "log" top: "tile" tile_param { axis: 1 tiles: 2 } }
layer { name: "thr" type: "Threshold" bottom: "tile" top: "thr" threshold_param { threshold: 0.5 } }
layer { name: "silence" type: "Silence" bottom: "thr" }
layer { name: "red" type: "Reduction" bottom: "bias" top: "red" reduction_param { operation: SUMSQ axis: 1 coeff: 0.01 } }
layer { name: "red2" type: "Reduction" bottom: "tile" top: "red2" reduction_param { operation: ASUM axis: 1 coeff: 0.01 } }
layer { name: "ip" type: "InnerProduct" bottom: "log" top: "ip" inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "argmax" type: "ArgMax" bottom: "ip" top: "argmax" argmax_param { top_k: 2 out_max_val: true } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "hinge" type: "HingeLoss" bottom: "ip" bottom: "label" top: "hinge" loss_weight: 0.5 hinge_loss_param { norm: L2 } }
layer { name: "eu" type: "EuclideanLoss" bottom: "red" bottom: "red2" top: "eu" loss_weight: 0.3 }
""",
}
ZOO_NETS["embed_and_losses"] = """
name: "ZooB"
layer { name: "data" type: "DummyData" top: "feat" top: "words" top: "label" top: "sim" top: "h" top: "target"
  dummy_data_param { shape { dim: 16 dim: 24 } shape { dim: 16 dim: 50 } shape { dim: 16 } shape { dim: 16 }
    shape { dim: 6 dim: 6 } shape { dim: 16 dim: 6 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 }
    data_filler { type: "uniform" min: 0 max: 5.99 } data_filler { type: "uniform" min: -1.5 max: 1.5 }
    data_filler { type: "positive_unitball" } data_filler { type: "uniform" min: 0 max: 1 } } }
layer { name: "ids" type: "ArgMax" bottom: "words" top: "ids" argmax_param { axis: 1 top_k: 3 } }
layer { name: "embed" type: "Embed" bottom: "ids" top: "emb"
  embed_param { input_dim: 50 num_output: 8 weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "flat" type: "Reshape" bottom: "emb" top: "emb_flat" reshape_param { shape { dim: 0 dim: -1 } } }
layer { name: "sum" type: "Eltwise" bottom: "feat" bottom: "emb_flat" top: "sum" }
layer { name: "mvn" type: "MVN" bottom: "sum" top: "mvn" mvn_param { across_channels: true } }
layer { name: "slice" type: "Slice" bottom: "mvn" top: "a" top: "b" slice_param { axis: 1 } }
layer { name: "contrastive" type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "sim" top: "closs" contrastive_loss_param { margin: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "mvn" top: "ip" inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "sce" type: "SigmoidCrossEntropyLoss" bottom: "ip" bottom: "target" top: "sce" }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
layer { name: "mlog" type: "MultinomialLogisticLoss" bottom: "prob" bottom: "label" top: "mlog" }
layer { name: "infogain" type: "InfogainLoss" bottom: "ip" bottom: "label" bottom: "h" top: "infogain" }
"""


@pytest.mark.parametrize("name", sorted(ZOO_NETS))
def test_zoo_net_forward_backward_matches_cpu(gpu, name):
    """Every zoo layer in a Net on both backends: the DummyData batches, the loss and every parameter gradient."""
    nets, losses = one_iteration_on_both(gpu, ZOO_NETS[name])
    for layer in nets["cpu"].layers_in_prototxt_order():
        if layer.layer.type_name == "DummyData":
            for top in layer.layer.param.top:
                close(nets["cuda"].blob(top), nets["cpu"].blob(top), rtol=1e-6, atol_scale=1e-6)
    assert_param_grads_match(nets, losses, name)
