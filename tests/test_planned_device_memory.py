"""Device memory the runtime used to allocate beside the pool, now planned or from the pool: the grouped solver
update's tables are a pool tensor of the plan (`#update`), Crop's window geometry travels in the kernel's
arguments, and a net with them trains bit for bit the same in every memory mode, in float32 and in bfloat16.

The GPU side (the pool's bytes covering cuDNN's measuring output and the fallback copies) is in
test_gpu_scratch.py; the Crop kernel runs under the simulator in test_cuda_zoo_ops_sim.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.backend.cpu import CpuBackend
from superneurons.memory.plan import make_plan, to_json
from superneurons.memory.pool import round_up
from superneurons.solver import Solver
from superneurons.solver.fused_update import CHUNK, ENV, table_entries
from test_solver import Quiet, solver_param

SGD = 'type: "SGD" base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 weight_decay: 0.01 max_iter: 3 ' \
      'snapshot_after_train: false'

# A deconvolution cropped back to its input's size (FCN's pattern), through a convolution into a loss.
CROP_NET = """
name: "crop"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 }
    shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "up" type: "Deconvolution" bottom: "conv" top: "up"
  convolution_param { num_output: 3 kernel_size: 4 stride: 2 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "crop" type: "Crop" bottom: "up" bottom: "data" top: "crop" crop_param { axis: 2 offset: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "crop" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _solver(memory: str = "baseline", **kw) -> Solver:
    return Solver(solver_param(SGD, net=CROP_NET), "s.prototxt", memory=memory, log=Quiet(), **kw)


def _state(solver: Solver) -> list[bytes]:
    net = solver.net
    return [net.backend.to_host(t.array).tobytes() for t in net.tensors if t.kind == "param"] + \
           [h.tobytes() for h in solver.history_blobs()]


def test_the_grouped_updates_tables_are_a_planned_pool_tensor(monkeypatch):
    solver = _solver("liveness")
    net = solver.net
    table = net.update_table
    assert table is not None and table.key == "#update" and net.pool.owns(table.key)
    assert table.nbytes == 8 * table_entries([d.data.size for d in net.learnable])
    assert table.key in net.memory.plan.program.resident
    # The update allocates nothing beside the pool: its tables are that tensor.
    monkeypatch.setattr(CpuBackend, "arena", lambda *a: pytest.fail("an allocation beside the pool"))
    solver.step(2)
    grouped = solver._grouped
    assert grouped is not None and grouped.rebuilds == 1
    for view in (grouped._segments, grouped._blocks_view, grouped._factors_view):
        assert np.shares_memory(view, table.array)


def test_the_plan_counts_the_tables_in_every_modes_peak_and_in_no_step():
    graph = _solver().net.graph
    plain = make_plan(graph, solver_history=1)
    grouped = make_plan(graph, solver_history=1, update_chunk=CHUNK)
    nbytes = grouped.program.tensors["#update"].nbytes
    assert nbytes == round_up(8 * table_entries(_param_lengths()))
    assert grouped.layer_bytes == plain.layer_bytes  # no step uses them: the solver does, between iterations
    for mode in plain.traces:
        assert grouped.peak(mode)[0] == plain.peak(mode)[0] + nbytes
        assert grouped.need(mode)[0] == plain.need(mode)[0] + nbytes
    doc = to_json(grouped, 2)
    assert doc["update_table_bytes"] == nbytes and to_json(plain, 2)["update_table_bytes"] == 0


def _param_lengths() -> list[int]:
    """conv (4x3x3x3 + 4), up (4x3x4x4 + 3), ip (3 x 3*6*6 + 3), in route order: what the table covers."""
    return [4 * 3 * 3 * 3, 4, 4 * 3 * 4 * 4, 3, 3 * 3 * 6 * 6, 3]


def test_no_tables_without_the_grouped_update(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    solver = _solver()
    assert solver.net.update_table is None and solver._grouped is None
    assert not any(t.key == "#update" for t in solver.net.tensors)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_mode_trains_bit_identically_to_baseline(precision):
    """Crop (geometry by value), the grouped update (tables in the pool) and, in bfloat16, the loss's planned
    float32 copies: every mode's weights and history equal baseline's bit for bit."""
    kw = {} if precision == "fp32" else {"precision": precision}
    reference = _solver("baseline", **kw)
    reference.solve()
    assert reference._grouped is not None
    for memory in ("liveness", "offload", "recompute"):
        solver = _solver(memory, **kw)
        solver.solve()
        assert solver._grouped is not None, memory
        assert _state(solver) == _state(reference), memory


CHANNELS_LAST_NET = """
name: "nhwc"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _graph(text: str):
    from google.protobuf import text_format

    from superneurons.graph.build import build_graph
    from superneurons.proto import superneurons_pb2 as pb

    return build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)


def test_a_channels_last_nets_layout_conversions_are_buffers_of_their_steps(monkeypatch):
    """The first convolution reads the NCHW batch and the pooling writes the NCHW blob the InnerProduct reads: each
    declares a room for those blobs' NHWC copies in its forward and its backward step (graph/layout.py), which the
    plan counts in that step's l_i and nowhere else."""
    from superneurons.graph.layout import choose
    from superneurons.memory.tensors import declare_tensors

    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    graph = _graph(CHANNELS_LAST_NET)
    layouts = choose(graph, ("NCHW", "NHWC"))
    assert layouts.blob("conv") == "NHWC" and layouts.blob("data") == layouts.blob("pool") == "NCHW"
    layout = declare_tensors(graph, train=True, layouts=layouts)
    plan = make_plan(graph, plan_backward=False, layout=layout)
    program = plan.program
    for name, blob in (("conv", (2, 3, 8, 8)), ("pool", (2, 4, 4, 4))):
        values = 4 * int(np.prod(blob))
        forward, backward = f"{name}#layout_copies", f"{name}#layout_copies_bw"
        assert program.tensors[forward].nbytes == round_up(values)
        assert program.tensors[backward].nbytes == round_up(2 * values)  # the blob's values and its gradient
        holding = [(s.index, s.phase) for s in program.steps if forward in s.uses or backward in s.uses]
        assert [phase for _s, phase in holding] == ["forward", "backward"]
        assert all(s.node.name == name for s in program.steps if forward in s.uses or backward in s.uses)
    assert layout.copies is None  # no reserve unless SUPERNEURONS_COPY_RESERVE asks for one
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nchw")
    nchw = _graph(CHANNELS_LAST_NET)
    assert not any("layout_copies" in k for k in make_plan(nchw, plan_backward=False).program.tensors)


@pytest.mark.parametrize("precision", ["FLOAT", "BFLOAT16"])
def test_the_reserve_for_refused_ops_is_planned_for_half_nets_only(monkeypatch, precision):
    """SUPERNEURONS_COPY_RESERVE plans `#copies` in a net whose ops may refuse their arguments (half types here):
    resident and in every step, as the scratch region; a float32 NCHW net's ops never do, so it plans none."""
    monkeypatch.setenv("SUPERNEURONS_COPY_RESERVE", "5000")
    text = CROP_NET if precision == "FLOAT" else CROP_NET.replace('name: "crop"\n', 'name: "crop"\ndefault_forward_type: '
                                                                   'BFLOAT16 default_backward_type: BFLOAT16\n', 1)
    plan = make_plan(_graph(text), plan_backward=False)
    program = plan.program
    if precision == "FLOAT":
        assert "#copies" not in program.tensors
        return
    assert program.tensors["#copies"].nbytes == round_up(5000) and "#copies" in program.resident
    assert all("#copies" in s.uses for s in program.steps)


def test_the_net_installs_each_steps_room_and_leaves_it_after(monkeypatch):
    """A half net hands the GPU ops, around each layer call, the room its copies come from (the reserve here, pool
    memory) and takes it back after, so ops outside a step never write into it."""
    monkeypatch.setenv("SUPERNEURONS_COPY_RESERVE", "3000")
    events = []

    class Recording(CpuBackend):
        def install_copy_room(self, region, where):
            events.append(("in", where, region))

        def leave_copy_room(self):
            events.append(("out",))

    solver = Solver(solver_param(SGD.replace("max_iter: 3", "max_iter: 1"), net=CROP_NET), "s.prototxt",
                    memory="liveness", log=Quiet(), backend=Recording(), precision="bf16")
    solver.solve()
    net = solver.net
    reserve = next(t for t in net.tensors if t.key == "#copies")
    assert net.pool.owns(reserve.key) and reserve.nbytes == 3000
    entered = [e for e in events if e[0] == "in"]
    steps = len(net.forward_steps) + len(net.backward_steps)
    assert len(entered) == steps and events[1::2] == [("out",)] * steps  # each step: in, then out
    assert all(region is reserve.array for _in, _where, region in entered)
    assert [where for _in, where, _r in entered[:len(net.forward_steps)]] == [s.node.name for s in net.forward_steps]
