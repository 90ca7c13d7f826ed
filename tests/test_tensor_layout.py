"""Tensors are declared once (memory/tensors.py): the Net builds exactly the layout's tensors, and the plan its
memory manager runs counts exactly the Net's activation roots, whatever the net's views and shared weights."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons.dtypes import BFLOAT16, tensor_bytes
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.memory.liveness import Program
from superneurons.memory.tensors import PARAM_KINDS, declare_tensors, tensor_key
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from test_memory_modes import BACKEND, CONV_FAN, DENSE, _input, _layer, _mlp_with_loss, ip, train
from test_recompute_resnet import RESNET

SHARED = (  # two InnerProducts reading the same weights by name, and a Flatten (a view) between them
    _input((4, 2, 3), 4)
    + _layer("flat", "Flatten", ["data"], ["flat"])
    + _layer("fa", "InnerProduct", ["flat"], ["fa"],
             'param { name: "w" } param { name: "b" } inner_product_param { num_output: 6 '
             'weight_filler { type: "gaussian" std: 0.1 } }')
    + _layer("fb", "InnerProduct", ["fa"], ["fb"],
             'param { name: "w2" } inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.1 } }')
    + _layer("fc", "InnerProduct", ["fb"], ["fc"],
             'param { name: "w2" } inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.1 } }')
    + ip("out", "fc", "out", 3)
    + _layer("loss", "SoftmaxWithLoss", ["out", "label"], ["loss"])
)

# A Flatten reading an input under force_backward: its bottom's gradient is declared before its top's, which
# is a view of it (the planner once made the top gradient a root of its own here).
FORCED = "force_backward: true\n" + _input((4, 2, 3), 4) + _layer("flat", "Flatten", ["data"], ["flat"]) + ip(
    "fc", "flat", "fc", 3) + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])

NETS = {"fan": CONV_FAN, "dense": DENSE, "mlp": _mlp_with_loss(), "resnet": RESNET, "shared": SHARED, "forced": FORCED}


def _graph(text: str, phase=pb.TRAIN):
    return build_graph(text_format.Parse('name: "t"\n' + text, pb.NetParameter()), phase)


@pytest.mark.parametrize("name", list(NETS))
@pytest.mark.parametrize("mode", ["baseline", "recompute"])
def test_the_net_builds_the_layout_and_the_plan_counts_its_roots(name, mode):
    net = Net(_graph(NETS[name]), BACKEND, memory=mode, solver_history=1)
    got = [(t.key, t.shape, t.dtype, t.kind, t.base.key if t.base is not None else None) for t in net.tensors]
    assert got == [(s.key, s.shape, s.dtype, s.kind, s.base) for s in net.layout.specs]
    # The planner, declaring on its own with the same function, finds the Net's activation roots.
    roots = {t.key for t in net.tensors if t.base is None and t.kind not in PARAM_KINDS}
    assert set(Program(net.graph, train=True).tensors) == roots
    for blob, t in net.data.items():
        assert t.key == tensor_key("data", blob)
    for blob, t in net.diff.items():
        assert t.key == tensor_key("diff", blob)
    assert [[t.key for t in hs] for hs in net.history] == [
        [tensor_key("history", d.data_tensor.key, 0) for d in net.learnable]]


def test_shared_weights_are_declared_once_and_read_by_their_sharers():
    net = Net(_graph(SHARED), BACKEND)
    fb, fc = net.layer("fb").params[0], net.layer("fc").params[0]
    assert fc.owner is fb and fb.owner is None and fc.data is fb.data
    assert tensor_key("param", "fc", 0) not in {t.key for t in net.tensors}
    assert sum(1 for d in net.learnable if d is fb) == 1
    # Flatten's top and its gradient are views; the gradient of a forced input exists for it.
    assert net.data["flat"].base is net.data["data"]
    forced = Net(_graph(FORCED), BACKEND)
    assert forced.diff["flat"].base is forced.diff["data"]


def test_a_test_net_borrows_the_train_nets_parameters():
    train = Net(_graph(SHARED), BACKEND)
    test = Net(_graph(SHARED, pb.TEST), BACKEND, train=False, share_params_with=train)
    assert not [t for t in test.tensors if t.kind in PARAM_KINDS]
    assert all(slot.borrowed for slot in test.layout.params)
    assert test.layer("fa").params[0].data is train.layer("fa").params[0].data


def test_a_shared_parameter_of_another_shape_is_a_user_error():
    text = SHARED.replace('"fc" type: "InnerProduct" bottom: "fb" top: "fc" param { name: "w2" } '
                          'inner_product_param { num_output: 6', '"fc" type: "InnerProduct" bottom: "fb" top: "fc" '
                          'param { name: "w2" } inner_product_param { num_output: 5')
    assert text != SHARED
    with pytest.raises(UserError, match=r"layer 'fc': shared param 'w2' has shape \(5, 6\), its owner has \(6, 6\)"):
        declare_tensors(_graph(text), train=True)


def test_a_forced_flatten_over_an_input_trains_in_every_mode():
    """The net the planner and the Net once disagreed on (the Net refused to build under liveness)."""
    _, ref, ref_losses = train(FORCED, "baseline")
    for mode in ("liveness", "offload", "recompute"):
        _, got, losses = train(FORCED, mode)
        assert (got, losses) == (ref, ref_losses), mode


def test_every_tensor_has_a_role_an_owner_a_layout_and_elements_times_size_bytes():
    graph = _graph(SHARED)
    layout = declare_tensors(graph, train=True, history=1)
    producer = {t: n.name for n in graph.nodes for t in n.tops}
    role = {"data": "activation", "diff": "gradient", "buffer": "scratch", "param": "parameter",
            "param_diff": "gradient", "history": "history"}
    for s in layout.specs:
        if s.key == layout.scratch:  # the net's float64 scratch region: no layer owns it
            assert (s.key, s.role, s.owner, s.dtype, s.nbytes) == ("#scratch", "scratch", None, np.float64,
                                                                  s.shape[0] * 8)
            continue
        assert s.role == role[s.kind] and s.layout == "NCHW" and s.dtype == np.float32
        assert s.nbytes == int(np.prod(s.shape, dtype=np.int64)) * 4
        assert s.owner in {n.name for n in graph.nodes}
        if s.kind == "data":
            assert s.owner == producer[s.key]
    by_owner = {s.key: s.owner for s in layout.specs}
    assert by_owner["fa.0"] == "fa" and by_owner["fa.0@history0"] == "fa"
    # The one byte count follows the element type: half types take 2 bytes an element.
    assert tensor_bytes((3, 5, 7), np.float16) == tensor_bytes((3, 5, 7), BFLOAT16) == 210
    assert tensor_bytes((3, 5, 7)) == 420 and tensor_bytes(()) == 4
