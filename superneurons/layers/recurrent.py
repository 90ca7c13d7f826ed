"""Caffe's recurrent layers: RNN and LSTM over (T, N, ...) sequences, and LSTMUnit, the LSTM cell of one step.

Bottoms: x (T time steps, N streams, ...), cont (T, N), whose 0 at (t, n) starts a new sequence in stream n
(the state carried from step t-1 is multiplied by it), then an optional static input x_static (N, ...) seen
at every step, then with `expose_hidden` the initial state: h_0 (RNN), h_0 and c_0 (LSTM), each (1, N,
num_output). Tops: the outputs of every step (T, N, num_output), then with `expose_hidden` the final state
(h_T; h_T and c_T). Without `expose_hidden` the initial state is zero.

Caffe runs each such layer as an inner net unrolled over the T steps. Here the unrolled steps are the
runtime's own: `unroll` rewrites the layer into the same per-step layers (Slice, Scale, InnerProduct,
Eltwise, TanH or LSTMUnit, Concat) sharing their weights by parameter name, which graph.build puts in the
net in its place. Liveness, offload and recomputation then plan every time step like any other layer, and
`superneurons memory` shows them. The layer of the prototxt stays in the net as the input transform -- it
keeps the prototxt's name and owns every weight in Caffe's blob order, so caffemodels and pycaffe see Caffe's
blobs; the step layers are named `<layer>/<Caffe's inner name>` and are not saved.

The input transform W_xc x_t + b_c takes one of two forms (graph.build picks; docs/MEMORY.md says when):
  - sequence (Caffe's): the head transforms x for all T steps in one matrix product (T, N, G), which a Slice
    hands to the steps. Fewest layers per step: the form of baseline and liveness, where every step's
    activations stay on the device anyway and each layer per step costs host time.
  - step: the head transforms x_1 only and every later step its own x_t (`_StepTransform`, an InnerProduct
    sharing W_xc), so that nothing of (T, N, G) exists at once: a step's gate input is rebuilt in backward
    from the step's own tensors (the state before it and x_t), which is what lets recomputation and offload
    keep only the per-step state (memory.RECURRENT_CHECKPOINTS).
Both compute the same function: they train to the same weights up to float rounding (the gradient of W_xc
adds its T steps up in one matrix product or step by step).

    LSTM (blobs W_xc, b_c[, W_xc_static], W_hc):
        gate_input_t = W_hc (cont_t h_{t-1}) + W_xc x_t + b_c [+ W_xc_static x_static]
        (c_t, h_t) = LSTMUnit(c_{t-1}, gate_input_t, cont_t)          (backend/cpu/recurrent.py)
    RNN (blobs W_xh, b_h[, W_xh_static], W_hh, W_ho, b_o):
        h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h [+ W_xh_static x_static])
        o_t = tanh(W_ho h_t + b_o)
"""
from __future__ import annotations

from superneurons.layers.base import NEEDS_BOTTOM, Layer, register
from superneurons.layers.inner_product import InnerProduct
from superneurons.proto import superneurons_pb2 as pb


@register("LSTMUnit")
class LSTMUnit(Layer):
    """Bottoms c_{t-1} (1, N, H), the gate input (1, N, 4H) and cont_t (1, N); tops c_t and h_t (1, N, H)."""

    n_bottoms = (3, 3)
    n_tops = (2, 2)
    label_bottoms = (2,)  # Caffe cannot backpropagate to the sequence indicators either

    def setup(self, bottom_shapes):
        c_prev, gates, cont = (tuple(s) for s in bottom_shapes)
        for k, (shape, axes) in enumerate(((c_prev, 3), (gates, 3), (cont, 2))):
            if len(shape) != axes or shape[0] != 1:
                raise self.fail(f"bottom {k} must be {axes}-D with one time step (1, N{', ...' * (axes > 2)}), "
                                f"got {shape}")
            if shape[1] != c_prev[1]:
                raise self.fail(f"bottom {k} has {shape[1]} streams, bottom 0 has {c_prev[1]}")
        if gates[2] != 4 * c_prev[2]:
            raise self.fail(f"the gate input (bottom 1) must be 4 x {c_prev[2]} = {4 * c_prev[2]} wide, "
                            f"got {gates[2]}")
        return [c_prev, c_prev]

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})  # the gates and c_t are recomputed from the bottoms

    def forward(self, bottom, top):
        self.ops.lstm_unit_forward(bottom[0], bottom[1], bottom[2], top[0], top[1])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        self.ops.lstm_unit_backward(bottom[0], bottom[1], bottom[2], top_diff[0], top_diff[1],
                                    bottom_diff[0] if propagate_down[0] else None,
                                    bottom_diff[1] if propagate_down[1] else None)


class _Recurrent(Layer):
    """What RNN and LSTM share: the bottoms' checks, the input transform, and the unrolled steps' wiring."""

    n_bottoms = (2, 5)
    n_tops = (1, 3)
    label_bottoms = (1,)  # cont
    unrolls = True
    # Per subclass: the recurrent state blobs ("h", or "h" and "c"), the names of the input transform's tops
    # (x's, x_static's: Caffe's), the class of the input transform and the name of the outputs' Concat.
    state_names: tuple[str, ...] = ()
    input_blobs: tuple[str, str] = ("", "")
    transform_class: type[Layer]
    concat_name = ""
    per_step = False  # the form `unroll` was asked for (its docstring)

    def setup(self, bottom_shapes):
        p = self.param.recurrent_param
        if p.num_output < 1:
            raise self.fail(f"recurrent_param.num_output must be 1 or more, got {p.num_output}")
        self.hidden = int(p.num_output)
        states = len(self.state_names)
        exposed = states if p.expose_hidden else 0
        x, cont = bottom_shapes[0], bottom_shapes[1]
        if len(x) < 2:
            raise self.fail(f"bottom 0 (x) must have at least 2 axes (T time steps, N streams, ...), got {x}")
        self.steps, self.streams = int(x[0]), int(x[1])
        if tuple(cont) != (self.steps, self.streams):
            raise self.fail(f"bottom 1 (cont) must be (T, N) = ({self.steps}, {self.streams}), got {tuple(cont)}")
        extra = len(bottom_shapes) - 2 - exposed
        if extra not in (0, 1):
            raise self.fail(f"takes x, cont, an optional static input"
                            f"{f' and {exposed} initial state(s) (expose_hidden)' if exposed else ''}: "
                            f"{2 + exposed}..{3 + exposed} bottoms, got {len(bottom_shapes)}")
        self.static = extra == 1
        if self.static:
            xs = bottom_shapes[2]
            if len(xs) < 1 or xs[0] != self.streams:
                raise self.fail(f"bottom 2 (the static input) must be (N, ...) with N = {self.streams}, got {xs}")
        state_shape = (1, self.streams, self.hidden)
        for k, shape in enumerate(bottom_shapes[2 + extra:]):
            if tuple(shape) != state_shape:
                raise self.fail(f"bottom {2 + extra + k} (initial {self.state_names[k]}_0) must be "
                                f"{state_shape}, got {tuple(shape)}")
        if len(self.param.top) != 1 + exposed:
            raise self.fail(f"has {1 + exposed} top(s) (the outputs{', then the final state' * bool(exposed)}), "
                            f"got {len(self.param.top)}")
        return [(self.steps, self.streams, self.hidden)] + [state_shape] * exposed

    # ---- the unrolled form ------------------------------------------------------------------------------
    def unroll(self, per_step: bool = False) -> list[tuple[pb.LayerParameter, type[Layer] | None]]:
        """The layers that replace this one in the net, in order, each with the class that builds it (None:
        its registered type); the input transform (`_InputTransform`) keeps this layer's name. `per_step`:
        the step form (each step transforms its own x_t), else the sequence form (module docstring)."""
        name = self.name
        bottoms, tops = list(self.param.bottom), list(self.param.top)
        states = len(self.state_names)
        exposed = bool(self.param.recurrent_param.expose_hidden)
        x_t, x_static = self.input_blobs
        head = pb.LayerParameter()
        head.CopyFrom(self.param)
        del head.bottom[:], head.top[:], head.propagate_down[:], head.loss_weight[:]
        head.bottom.append(f"{name}/x_1" if per_step else bottoms[0])
        head.top.append(f"{name}/{x_t}_1" if per_step else f"{name}/{x_t}")
        if self.static:
            head.bottom.append(bottoms[2])
            head.top.append(f"{name}/{x_static}")
        if self.param.propagate_down:
            head.propagate_down.extend([self.param.propagate_down[0]] +
                                       ([self.param.propagate_down[2]] if self.static else []))
        self.fill_param_names(head)
        self.per_step = per_step
        steps = range(1, self.steps + 1)
        out: list[tuple[pb.LayerParameter, type[Layer] | None]] = []
        if per_step:
            x_slice = self._part("x_slice", "Slice", [bottoms[0]], [f"{name}/x_{t}" for t in steps],
                                 slice_param=pb.SliceParameter(axis=0))
            if self.param.propagate_down:
                x_slice.propagate_down.append(self.param.propagate_down[0])
            out.append((x_slice, None))
        out.append((head, self.transform_class))
        if exposed:
            first = {s: bottoms[len(bottoms) - states + k] for k, s in enumerate(self.state_names)}
        else:
            first = {s: f"{name}/{s}_0" for s in self.state_names}
            out.append((self._carried_state(list(first.values()), []), _CarriedState))
        out.append((self._part("cont_slice", "Slice", [bottoms[1]], [f"{name}/cont_{t}" for t in steps],
                               slice_param=pb.SliceParameter(axis=0)), None))
        if not per_step:
            out.append((self._part(f"{x_t}_slice", "Slice", [f"{name}/{x_t}"],
                                   [f"{name}/{x_t}_{t}" for t in steps], slice_param=pb.SliceParameter(axis=0)), None))
        outputs = []
        for t in steps:
            state = {s: (first[s] if t == 1 else f"{name}/{s}_{t - 1}") for s in self.state_names}
            if exposed and t == self.steps:
                last = {s: tops[1 + k] for k, s in enumerate(self.state_names)}
            else:
                last = {s: f"{name}/{s}_{t}" for s in self.state_names}
            parts, output = self.step(t, state, last)
            out += [(part, _StepTransform if part.type == "InnerProduct" and len(part.bottom) == 2 else None)
                    for part in parts]
            outputs.append(output)
        out.append((self._part(self.concat_name, "Concat", outputs, [tops[0]],
                               concat_param=pb.ConcatParameter(axis=0)), None))
        if not exposed:
            out.append((self._carried_state([], [f"{name}/{s}_{self.steps}" for s in self.state_names]),
                        _CarriedState))
        weights = dict(zip(tops, self.param.loss_weight))
        if any(weights.values()):  # a loss weight on a top goes to the part that produces it
            for part, _cls in out:
                if any(t in weights for t in part.top):
                    part.loss_weight.extend(weights.get(t, 0.0) for t in part.top)
        return out

    def _carried_state(self, tops: list[str], bottoms: list[str]) -> pb.LayerParameter:
        """The part that gives the first step the state the last step of the previous forward left (tops), or
        the one that keeps the last step's state for the next forward (bottoms). Each net has its own state:
        the phase is in the name, so a test net does not borrow the training net's (as in Caffe)."""
        phase = pb.Phase.Name(self.phase).lower()
        role = "state" if tops else "keep_state"
        part = self._part(f"{phase}_{role}", "RecurrentState", bottoms, tops)
        for _top in tops:
            part.input_param.shape.add().dim.extend([1, self.streams, self.hidden])
        for s in self.state_names:
            for kept in (("held", "next") if tops else ("next",)):
                part.param.add(name=f"{self.name}/{phase}_{s}_{kept}", lr_mult=0, decay_mult=0)
        return part

    def fill_param_names(self, head: pb.LayerParameter) -> None:
        """Name every blob of the head (the prototxt's names kept), so the steps can share them by name."""
        names = self.blob_names()
        while len(head.param) < len(names):
            head.param.add()
        for spec, blob in zip(head.param, names):
            if not spec.name:
                spec.name = f"{self.name}/{blob}"
        self.shared = {blob: spec for blob, spec in zip(names, head.param)}

    def blob_names(self) -> list[str]:
        raise NotImplementedError

    def step(self, t: int, state: dict[str, str], last: dict[str, str]) -> tuple[list[pb.LayerParameter], str]:
        """The layers of time step t from the state blobs `state` (t - 1) to `last` (t), and its output blob."""
        raise NotImplementedError

    def shared_ip(self, part: str, bottom: str, top: str, blobs: tuple[str, ...], width: int):
        """A step's InnerProduct over axis 2 (`width` outputs), its weights the head's blobs `blobs` (by name):
        a weight, and a bias when two are named."""
        rp = self.param.recurrent_param
        bias = len(blobs) == 2
        ip = pb.InnerProductParameter(num_output=width, bias_term=bias, axis=2, weight_filler=rp.weight_filler)
        if bias:
            ip.bias_filler.CopyFrom(rp.bias_filler)
        layer = self._part(part, "InnerProduct", [bottom], [top], inner_product_param=ip)
        for blob in blobs:
            layer.param.add().CopyFrom(self.shared[blob])
        return layer

    def conted(self, t: int, h_prev: str) -> tuple[pb.LayerParameter, str]:
        """h_conted_{t-1} = cont_t * h_{t-1}: the state a new sequence does not see."""
        top = f"{self.name}/h_conted_{t - 1}"
        scale = self._part(f"h_conted_{t - 1}", "Scale", [h_prev, f"{self.name}/cont_{t}"], [top],
                           scale_param=pb.ScaleParameter(axis=0))
        scale.propagate_down.extend([True, False])
        return scale, top

    def x_transform(self, t: int, h_prev: str, blobs: tuple[str, str], width: int) -> list[pb.LayerParameter]:
        """The step form's W x_t + b of step t, from the head's weights `blobs` (by name); step 1's is the head
        itself. It also reads h_{t-1} (`_StepTransform`), which the step's Scale reads in forward and backward
        anyway. None in the sequence form: the head transformed every step's x_t."""
        if t == 1 or not self.per_step:
            return []
        ip = self.shared_ip(f"{self.input_blobs[0]}_{t}", f"{self.name}/x_{t}",
                            f"{self.name}/{self.input_blobs[0]}_{t}", blobs, width)
        ip.bottom.append(h_prev)
        return [ip]

    def gate_sum(self, part: str, top: str, recurrent: str, t: int) -> pb.LayerParameter:
        bottoms = [recurrent, f"{self.name}/{self.input_blobs[0]}_{t}"]
        if self.static:
            bottoms.append(f"{self.name}/{self.input_blobs[1]}")
        return self._part(part, "Eltwise", bottoms, [top], eltwise_param=pb.EltwiseParameter(operation="SUM"))

    def _part(self, part: str, type_name: str, bottoms: list[str], tops: list[str], **fields) -> pb.LayerParameter:
        return pb.LayerParameter(name=f"{self.name}/{part}", type=type_name, bottom=bottoms, top=tops, **fields)


class _StepTransform(InnerProduct):
    """W x_t + b of one time step (bottom 0, x_t). Bottom 1, h_{t-1}, is not read: it places the step in the
    route after the previous step (graph/route.py runs a layer as soon as its bottoms exist, so without it every
    step's transform would run right after the Slice of x, and all T outputs would be on the device at once)."""

    n_bottoms = (2, 2)
    order_bottoms = (1,)

    def setup(self, bottom_shapes):
        return super().setup(bottom_shapes[:1])


class _CarriedState(Layer):
    """The state a recurrent layer without expose_hidden carries from one forward pass to the next, as Caffe's
    does: the last time step's h (and c) become the next pass's initial state, zero before the first pass,
    and cont = 0 at a stream's first step ignores it. Two parts share the state blobs by name (not learnable,
    never saved): one without bottoms whose tops are the initial state, one without tops that reads the last
    step's state. The reader writes a "next" blob, which the giver moves to its "held" blob at the start of
    a pass and not when a recomputation replays its forward, so a replay reads the state the pass began with."""

    type_name = "RecurrentState"
    n_bottoms = (0, 2)
    n_tops = (0, 2)
    has_backward = False  # the initial state gets no gradient (Caffe discards it too)

    def setup(self, bottom_shapes):
        # the giver learns the state's shape from its input_param, the keeper from its bottoms
        shapes = [tuple(s.dim) for s in self.param.input_param.shape] if self.param.top else bottom_shapes
        if self.param.top:
            pairs = [(self.add_param(s, None, learnable=False), self.add_param(s, None, learnable=False))
                     for s in shapes]
            self.held, self.next = [h for h, _ in pairs], [n for _, n in pairs]
        else:
            self.held, self.next = [], [self.add_param(s, None, learnable=False) for s in shapes]
        return [tuple(s) for s in shapes] if self.param.top else []

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        if top:
            for held, nxt, t in zip(self.held, self.next, top):
                if not self.ctx.recomputing:
                    self.ops.copy(nxt.data, held.data)
                self.ops.copy(held.data, t)
        else:
            for nxt, b in zip(self.next, bottom):
                self.ops.copy(b, nxt.data)


class _InputTransform(Layer):
    """The recurrent layer of the prototxt once unrolled (`_Recurrent.unroll`): x (T, N, D) -> W x + b (T, N, G)
    for every time step at once in the sequence form, the first step's x_1 (1, N, D) -> W x_1 + b (1, N, G) in
    the step form (the later steps' transforms are InnerProducts sharing W and b); and x_static (N, ...) ->
    W_static x_static (1, N, G), where G is the gate width. It owns every blob of the layer in Caffe's order,
    the recurrent ones included (the steps share them by name), so a caffemodel's blobs for the layer land
    here."""

    n_bottoms = (1, 2)
    n_tops = (1, 2)
    # The blobs of the recurrent weights that only the steps use, after the input transform's own
    recurrent_blobs: tuple[tuple[int, bool], ...] = ()  # (rows as a multiple of num_output, has a bias)
    gates = 1

    def setup(self, bottom_shapes):
        p = self.param.recurrent_param
        hidden = int(p.num_output)
        width = self.gates * hidden
        x = bottom_shapes[0]
        self.x_ip = self._ip(x, 2, width, True)
        out = [(x[0], x[1], width)]
        self.static_ip = None
        if len(bottom_shapes) == 2:
            xs = bottom_shapes[1]
            self.static_ip = self._ip(xs, 1, width, False)
            out.append((1, xs[0], width))
        for rows, bias in self.recurrent_blobs:
            self.add_param((rows * hidden, hidden), p.weight_filler)
            if bias:
                self.add_param((rows * hidden,), p.bias_filler)
        return out

    def _ip(self, shape, axis: int, width: int, bias: bool) -> InnerProduct:
        p = self.param.recurrent_param
        ip = pb.InnerProductParameter(num_output=width, bias_term=bias, axis=axis, weight_filler=p.weight_filler)
        if bias:
            ip.bias_filler.CopyFrom(p.bias_filler)
        layer = InnerProduct(pb.LayerParameter(name=self.name, type="InnerProduct", bottom=["x"], top=["y"],
                                               inner_product_param=ip), self.phase)
        try:
            layer.setup([shape])
        finally:
            self.params += layer.params  # in Caffe's order: W_x, b (the x transform), then W_static
        return layer

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})

    # The transforms' weights are read in the storage type, as InnerProduct's are: their half working copies are
    # the inner InnerProducts' own, declared here too so that the plan and the runtime see them.
    data_typed_params = (0,)

    def use_working_copies(self, data_type) -> None:
        for role, ip in zip(("x", "static"), self._ips()):
            ip.use_working_copies(data_type)
            for name, decl in ip.buffers.items():
                self.buffers[f"{role}_{name}"] = decl

    def forward_flops(self):
        return sum(ip.forward_flops() for ip in self._ips())

    def scratch_entries(self):
        return max(ip.scratch_entries() for ip in self._ips())  # one transform after the other

    def _ips(self) -> list[InnerProduct]:
        return [self.x_ip] + ([self.static_ip] if self.static_ip is not None else [])

    def forward(self, bottom, top):
        for ip, b, t in zip(self._ips(), bottom, top):
            ip.ops, ip.ctx = self.ops, self.ctx
            ip.forward([b], [t])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        for k, ip in enumerate(self._ips()):
            ip.ops, ip.ctx = self.ops, self.ctx
            ip.backward([top[k]], [top_diff[k]], [propagate_down[k]], [bottom[k]], [bottom_diff[k]])


class _LSTMTransform(_InputTransform):
    type_name = "LSTM"
    gates = 4
    recurrent_blobs = ((4, False),)  # W_hc


class _RNNTransform(_InputTransform):
    type_name = "RNN"
    recurrent_blobs = ((1, False), (1, True))  # W_hh; W_ho, b_o


@register("LSTM")
class LSTM(_Recurrent):
    state_names = ("h", "c")
    input_blobs = ("W_xc_x", "W_xc_x_static")
    transform_class = _LSTMTransform
    concat_name = "h_concat"

    def blob_names(self):
        return ["W_xc", "b_c"] + (["W_xc_static"] if self.static else []) + ["W_hc"]

    def step(self, t, state, last):
        name = self.name
        scale, h_conted = self.conted(t, state["h"])
        gate_input = f"{name}/gate_input_{t}"
        parts = [scale,
                 self.shared_ip(f"transform_{t}", h_conted, f"{name}/W_hc_h_{t - 1}", ("W_hc",), 4 * self.hidden),
                 *self.x_transform(t, state["h"], ("W_xc", "b_c"), 4 * self.hidden),
                 self.gate_sum(f"gate_input_{t}", gate_input, f"{name}/W_hc_h_{t - 1}", t),
                 self._part(f"unit_{t}", "LSTMUnit", [state["c"], gate_input, f"{name}/cont_{t}"],
                            [last["c"], last["h"]])]
        return parts, last["h"]


@register("RNN")
class RNN(_Recurrent):
    state_names = ("h",)
    input_blobs = ("W_xh_x", "W_xh_x_static")
    transform_class = _RNNTransform
    concat_name = "o_concat"

    def blob_names(self):
        return ["W_xh", "b_h"] + (["W_xh_static"] if self.static else []) + ["W_hh", "W_ho", "b_o"]

    def step(self, t, state, last):
        name = self.name
        scale, h_conted = self.conted(t, state["h"])
        neuron_input = f"{name}/h_neuron_input_{t}"
        parts = [scale,
                 self.shared_ip(f"W_hh_h_{t - 1}", h_conted, f"{name}/W_hh_h_{t - 1}", ("W_hh",), self.hidden),
                 *self.x_transform(t, state["h"], ("W_xh", "b_h"), self.hidden),
                 self.gate_sum(f"h_input_sum_{t}", neuron_input, f"{name}/W_hh_h_{t - 1}", t),
                 self._part(f"h_neuron_{t}", "TanH", [neuron_input], [last["h"]]),
                 self.shared_ip(f"W_ho_h_{t}", last["h"], f"{name}/W_ho_h_{t}", ("W_ho", "b_o"), self.hidden),
                 self._part(f"o_neuron_{t}", "TanH", [f"{name}/W_ho_h_{t}"], [f"{name}/o_{t}"])]
        return parts, f"{name}/o_{t}"

