"""ResNet-style in-place chains under every memory mode:
conv -> BatchNorm -> Scale -> ReLU all write one blob, the blocks join through Eltwise, and BatchNorm keeps
a buffer for backward. Fused (graph/fuse.py: the BatchNorm goes out of place and keeps the convolution's
output, now a blob of its own, `<blob>/bn_input`; Scale and ReLU keep nothing) and not (SUPERNEURONS_FUSE=0:
BatchNorm and Scale each keep a copy of their input), every mode must train byte-identically to baseline,
also with copies that lag and in pools that force tensors off the device."""
from __future__ import annotations

import pytest

from superneurons.memory.plan import make_plan
from superneurons.runtime.net import Net
from test_memory_modes import BACKEND, _check_modes, _graph, _input, _layer, conv, ip, train


def _bn_chain(name: str, blob: str, relu: bool = True) -> str:
    """BatchNorm -> Scale (-> ReLU), all in place on `blob` (Caffe's ResNet prototxts)."""
    text = (_layer(f"bn_{name}", "BatchNorm", [blob], [blob])
            + _layer(f"scale_{name}", "Scale", [blob], [blob], "scale_param { bias_term: true }"))
    return text + (_layer(f"relu_{name}", "ReLU", [blob], [blob]) if relu else "")


def _block(name: str, bottom: str, n: int, project: bool) -> str:
    """A bottleneck-style residual block: branch2 = conv-bn-relu, conv-bn; branch1 = identity or conv-bn."""
    text = conv(f"{name}_2a", bottom, f"{name}_2a", n) + _bn_chain(f"{name}_2a", f"{name}_2a")
    text += conv(f"{name}_2b", f"{name}_2a", f"{name}_2b", n) + _bn_chain(f"{name}_2b", f"{name}_2b", relu=False)
    short = bottom
    if project:
        short = f"{name}_1"
        text += conv(short, bottom, short, n, k=1, pad=0) + _bn_chain(short, short, relu=False)
    text += _layer(name, "Eltwise", [short, f"{name}_2b"], [name])
    return text + _layer(f"{name}_relu", "ReLU", [name], [name])


RESNET = (
    _input((2, 3, 8, 8), 2)
    + conv("conv1", "data", "conv1", 4) + _bn_chain("conv1", "conv1")
    + _layer("pool1", "Pooling", ["conv1"], ["pool1"], "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    + _block("res2a", "pool1", 5, project=True)
    + _block("res2b", "res2a", 5, project=False)
    + _layer("pool5", "Pooling", ["res2b"], ["pool5"], "pooling_param { pool: AVE kernel_size: 2 stride: 2 }")
    + ip("fc", "pool5", "fc", 6) + _layer("drop", "Dropout", ["fc"], ["fc"], "dropout_param { dropout_ratio: 0.3 }")
    + ip("fc2", "fc", "fc2", 3)
    + _layer("loss", "SoftmaxWithLoss", ["fc2", "label"], ["loss"])
)


@pytest.fixture(params=["fused", "unfused"])
def fusion(request, monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_FUSE", "1" if request.param == "fused" else "0")
    return request.param


def test_fusion_setting_changes_the_buffers(fusion):
    tensors = make_plan(_graph(RESNET)).program.tensors
    buffers = {k for k, t in tensors.items() if t.kind == "buffer"}
    if fusion == "fused":
        assert not {"bn_conv1#x_hat", "bn_conv1#x", "scale_conv1#x"} & buffers
        assert tensors["conv1/bn_input"].kind == "data"
    else:
        assert {"bn_conv1#x", "scale_conv1#x"} <= buffers and "conv1/bn_input" not in tensors


def test_resnet_block_all_modes_identical(fusion):
    _check_modes(RESNET)


@pytest.mark.parametrize("lag", [2])
def test_resnet_block_identical_with_lagging_copies(fusion, monkeypatch, lag):
    monkeypatch.setenv("SUPERNEURONS_TRANSFER_LAG", str(lag))
    _, ref, ref_losses = train(RESNET, "baseline")
    plan = make_plan(_graph(RESNET), plan_backward=False)
    params = Net(_graph(RESNET), BACKEND, memory="liveness").memory.param_bytes
    for mode in ("offload", "recompute"):
        for pool in (None, params + plan.peak(mode)[0] + 4096):
            net, got, losses = train(RESNET, mode, pool_bytes=pool)
            assert got == ref and losses == ref_losses, f"{mode}, pool {pool}, {fusion}"
            assert not net.memory.leaving and not net.memory.host.busy


def test_checkpoint_buffers_move_and_the_rest_is_dropped_or_moved(fusion):
    plan = make_plan(_graph(RESNET), plan_backward=False)
    program = plan.program
    rec = plan.schedules["recompute"].info
    movable, dropped = set(rec["offloadable"]), set(rec["dropped"])
    # The buffers in-place layers keep on a convolution's output can only be rebuilt by re-running the
    # convolution: they leave the device like the convolution's output itself. Fused, the BatchNorm keeps the
    # convolution's output itself (res2a_2a/bn_input), and res2a_2a is the chain's result.
    chain_buffers = {"res2a_2a/bn_input"} if fusion == "fused" else {"bn_res2a_2a#x", "scale_res2a_2a#x"}
    assert chain_buffers | {"res2a_2a", "data"} <= movable
    assert chain_buffers <= set(plan.schedules["offload"].info["offloadable"])
    # Every tensor backward reads either leaves the device, is rebuilt by a replay, or is an output (or the
    # ops' scratch region, which stays for the whole run).
    live = plan.liveness
    for k in program.tensors:
        if k in live.backward_first and k in live.forward_last:
            assert k in movable or k in dropped or k in program.pinned or k in program.scratch, k
    peaks = {m: plan.peak(m)[0] for m in plan.traces}
    assert peaks["baseline"] > peaks["liveness"] > peaks["offload"] >= peaks["recompute"]
    assert peaks["recompute"] <= 2 * plan.max_layer[1]


def test_a_pool_at_the_recompute_plan_moves_buffers_and_trains_identically(fusion, monkeypatch):
    from superneurons.memory.managers import OffloadManager

    evicted = []
    real_evict = OffloadManager._evict
    monkeypatch.setattr(OffloadManager, "_evict", lambda self, k: (evicted.append(k), real_evict(self, k)))
    _, ref, ref_losses = train(RESNET, "baseline")
    plan = make_plan(_graph(RESNET), plan_backward=False)
    params = Net(_graph(RESNET), BACKEND, memory="liveness").memory.param_bytes
    net, got, losses = train(RESNET, "recompute", pool_bytes=params + plan.peak("recompute")[0] + 2048)
    assert got == ref and losses == ref_losses
    mm = net.memory
    assert mm.bytes_offloaded > 0 and mm.bytes_prefetched > 0
    assert max(mm.trace) <= mm.net.pool.capacity - params
    kept = "res2a_2a/bn_input" if fusion == "fused" else "bn_res2a_2a#x"
    assert kept in evicted and "res2a_2a" in evicted  # what the BatchNorm keeps and the chain's result left
    if fusion == "unfused":  # pool1 reads conv1's final value, which ReLU's backward keeps: replayed, not moved
        assert mm.replays > 0 and "pool1" not in evicted
