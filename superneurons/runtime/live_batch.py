"""Running the layers after a Filter on the items it kept (graph/live_batch.py says which layers and blobs).

Each live blob's tensor is planned at the Filter's full N items; the kept ones sit at its front. Before a step
of a layer on live blobs, the Net asks `LiveRun` for what to call: the first S rows of each live blob (S: the
count the Filter kept this forward) and the layer with the attributes its setup gives for S items swapped in
for the call (graph/live_batch.py's Variant, made once per count and kept). The Filter itself gets its own
tops whole (it writes the front) and the first rows of live bottoms.
"""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError
from superneurons.graph.live_batch import LiveBatches, Variant, batch_variant
from superneurons.layers.base import Layer


class LiveRun:
    def __init__(self, graph: Any, live: LiveBatches, ops: Any):
        self.live = live
        self.ops = ops
        self.filters = {name: graph.node(name).layer for name in live.capacity}
        self.planned = graph.blob_shapes
        self.variants: dict[tuple[str, int], Variant] = {}
        # One view per tensor array and count, kept so a step sees the same array objects at every call
        # (the CUDA backend caches its views and kernel launches by array object).
        self._views: dict[int, tuple[Any, int, Any]] = {}

    def count(self, filter_name: str) -> int:
        """Items the Filter kept in its last forward (its full N before the first)."""
        n = self.filters[filter_name].selected
        return self.live.capacity[filter_name] if n is None else n

    def blob_rows(self, blob: str, array: Any) -> Any:
        """`array` (blob's tensor) cut to the live items when `blob` is live."""
        source = self.live.blob_filter.get(blob)
        if source is None or array is None:
            return array
        n = self.count(source)
        kept = self._views.get(id(array))
        if kept is not None and kept[0] is array and kept[1] == n:
            return kept[2]
        view = array[:n]
        self._views[id(array)] = (array, n, view)
        return view

    def _cut(self, blobs: list[str], arrays: list) -> list:
        """The arrays of one call cut alike: an array passed twice (in place) gives one view object twice."""
        return [self.blob_rows(b, a) for b, a in zip(blobs, arrays)]

    def _trim_views(self) -> None:
        if len(self._views) > 4096:  # views of arrays the memory manager has since replaced
            self._views.clear()

    def step_layer(self, node: Any, layer: Layer) -> Any:
        """What to call for node's step: `layer`, or, when it runs on live blobs, `layer` with its attributes
        set up for the current count swapped in for the call (made once per count and kept)."""
        source = self.live.node_filter.get(node.name)
        if source is None or getattr(layer, "selects_items", False):
            return layer
        n = self.count(source)
        key = (node.name, n)
        variant = self.variants.get(key)
        if variant is None:
            shapes = [self._shape(b, n) for b in node.bottoms]
            try:
                variant = batch_variant(layer, shapes)
            except UserError as e:
                raise UserError(f"layer {node.name!r} ({layer.type_name}) cannot run on the {n} item(s) Filter "
                                f"{source!r} kept: {e}") from None
            self.variants[key] = variant
        variant.refresh(self.ops)
        return _AtCount(layer, variant, source if n == 0 else None)

    def _shape(self, blob: str, n: int) -> tuple[int, ...]:
        shape = self.planned[blob]
        return (n,) + tuple(shape[1:]) if blob in self.live.blob_filter else tuple(shape)

    def forward_args(self, node: Any, layer: Layer, bottoms: list, tops: list) -> tuple[Layer, list, list]:
        if node.name not in self.live.node_filter and node.name not in self.live.capacity:
            return layer, bottoms, tops
        self._trim_views()
        own = getattr(layer, "selects_items", False)
        return (self.step_layer(node, layer), self._cut(node.bottoms, bottoms),
                tops if own else self._cut(node.tops, tops))

    def backward_args(self, node: Any, layer: Layer, tops: list, top_diffs: list, bottoms: list,
                      bottom_diffs: list) -> tuple[Layer, list, list, list, list]:
        if node.name not in self.live.node_filter and node.name not in self.live.capacity:
            return layer, tops, top_diffs, bottoms, bottom_diffs
        self._trim_views()
        own = getattr(layer, "selects_items", False)
        if not own:
            tops, top_diffs = self._cut(node.tops, tops), self._cut(node.tops, top_diffs)
        return (self.step_layer(node, layer), tops, top_diffs, self._cut(node.bottoms, bottoms),
                self._cut(node.bottoms, bottom_diffs))


class _AtCount:
    """The step's layer with a Variant's attributes swapped in for each call. On a selection of no item
    (`empty_of`: the Filter), Caffe's CPU layers run on empty blobs (a loss of 0, zero gradients) and so do the
    CPU ops here; a backend op that cannot take an empty array (cuDNN's descriptors refuse a batch of 0, as
    they do under Caffe) stops the run with one line naming the layer, not a backend traceback."""

    __slots__ = ("layer", "variant", "empty_of")

    def __init__(self, layer: Layer, variant: Variant, empty_of: str | None):
        self.layer, self.variant, self.empty_of = layer, variant, empty_of

    def _call(self, method: str, *args, **kwargs) -> None:
        with self.variant.swapped_in(self.layer) as layer:
            try:
                getattr(layer, method)(*args, **kwargs)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001  (any backend failure on the empty arrays)
                if self.empty_of is None:
                    raise
                first = str(e).splitlines()[0] if str(e) else ""
                raise UserError(f"layer {layer.name!r} ({layer.type_name}): Filter {self.empty_of!r} kept no item in "
                                f"this batch and this backend cannot run the layer's {method} on an empty batch "
                                f"({type(e).__name__}: {first})") from None

    def forward(self, bottom, top) -> None:
        self._call("forward", bottom, top)

    def backward(self, *args, **kwargs) -> None:
        self._call("backward", *args, **kwargs)
