"""Slice, Crop, Reshape, Tile and Silence: layers that move or drop values without arithmetic."""
from __future__ import annotations

from superneurons.layers.base import Layer, canonical_axis, count, register


@register("Slice")
class Slice(Layer):
    """Cut bottom 0 along an axis into the tops, at `slice_point`s or into equal parts."""

    channels_last = True  # Concat's ops, the other way round
    n_tops = (1, None)

    def setup(self, bottom_shapes):
        p = self.param.slice_param
        shape = bottom_shapes[0]
        if p.HasField("slice_dim"):
            if p.HasField("axis"):
                raise self.fail("give slice_param.axis or the legacy slice_dim, not both")
            axis = int(p.slice_dim)
        else:
            axis = int(p.axis)
        self.axis = canonical_axis(axis, len(shape), self)
        n_top = len(self.param.top)
        width = shape[self.axis]
        points = [int(q) for q in p.slice_point]
        if points:
            if len(points) != n_top - 1:
                raise self.fail(f"{len(points)} slice_point value(s) for {n_top} tops (need {n_top - 1})")
            bounds = [0] + points + [width]
            for lo, hi in zip(bounds, bounds[1:]):
                if hi <= lo:
                    raise self.fail(f"slice points {points} must increase strictly within (0, {width}) "
                                    f"along axis {self.axis}")
        else:
            if width % n_top:
                raise self.fail(f"axis {self.axis} has {width} entries, not divisible into {n_top} equal slices; "
                                f"give slice_point")
            bounds = [k * (width // n_top) for k in range(n_top + 1)]
        self.offsets = bounds[:-1]
        return [shape[:self.axis] + (hi - lo,) + shape[self.axis + 1:] for lo, hi in zip(bounds, bounds[1:])]

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        # Each top is the slab of the bottom at its offset: the backward of Concat.
        for t, offset in zip(top, self.offsets):
            self.ops.concat_backward(bottom[0], t, self.axis, offset)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            # The bottom diff is the top diffs joined: the forward of Concat.
            self.ops.concat_forward(top_diff, bottom_diff[0], self.axis)


@register("Crop")
class Crop(Layer):
    """Crop bottom 0 to bottom 1's shape on the axes from `axis` on, starting at `offset`."""

    n_bottoms = (2, 2)
    label_bottoms = (1,)  # only its shape is read

    def setup(self, bottom_shapes):
        p = self.param.crop_param
        src, ref = bottom_shapes
        if len(src) != len(ref):
            raise self.fail(f"bottom 0 has {len(src)} axes {src} but the reference bottom 1 has {len(ref)} {ref}")
        axis = canonical_axis(p.axis, len(src), self)
        n_crop = len(src) - axis
        given = [int(o) for o in p.offset]
        if len(given) > 1 and len(given) != n_crop:
            raise self.fail(f"{len(given)} offsets for {n_crop} cropped axes (from axis {axis}); give 0, 1 or "
                            f"{n_crop}")
        crop_offsets = given * n_crop if len(given) == 1 else (given or [0] * n_crop)
        self.offsets = [0] * axis + crop_offsets
        top = tuple(src[:axis]) + tuple(ref[axis:])
        for i in range(axis, len(src)):
            if self.offsets[i] + top[i] > src[i]:
                raise self.fail(f"axis {i}: offset {self.offsets[i]} + size {top[i]} exceeds bottom 0's "
                                f"size {src[i]}")
        return [top]

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        self.ops.crop_forward(bottom[0], top[0], self.offsets)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.crop_backward(top_diff[0], bottom_diff[0], self.offsets)


class ViewLayer(Layer):
    """A layer whose top is a view of its bottom with another shape: the runtime hands the top (and its
    diff) as views of the bottom's, so forward and backward have nothing to copy or compute."""

    shares_data = True
    shares_diff = True

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        pass  # top is a view of bottom

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass  # top diff is a view of bottom diff


@register("Reshape")
class Reshape(ViewLayer):
    """A new shape for the same values."""

    def setup(self, bottom_shapes):
        p = self.param.reshape_param
        shape = tuple(bottom_shapes[0])
        nd = len(shape)
        start = p.axis if p.axis >= 0 else nd + p.axis + 1
        if not 0 <= start <= nd:
            raise self.fail(f"reshape_param.axis {p.axis} out of range for a {nd}-D bottom")
        if p.num_axes < -1:
            raise self.fail(f"reshape_param.num_axes must be -1 or more, got {p.num_axes}")
        end = nd if p.num_axes == -1 else start + p.num_axes
        if end > nd:
            raise self.fail(f"reshape_param axis {start} with num_axes {p.num_axes} goes past the {nd} axes "
                            f"of the bottom {shape}")
        dims = [int(d) for d in p.shape.dim]
        new: list[int | None] = []
        for i, d in enumerate(dims):
            if d == 0:
                if start + i >= nd:
                    raise self.fail(f"shape dim {i} is 0 (copy) but the bottom has no axis {start + i}")
                new.append(shape[start + i])
            elif d == -1:
                if None in new:
                    raise self.fail(f"shape {dims} has more than one -1 (inferred) dimension")
                new.append(None)
            elif d < -1:
                raise self.fail(f"shape dim {i} is {d}; dims must be positive, 0 (copy) or -1 (infer)")
            else:
                new.append(d)
        top = list(shape[:start]) + new + list(shape[end:])
        known = count([d for d in top if d is not None])
        total = count(shape)
        if None in top:
            if known == 0 or total % known:
                raise self.fail(f"cannot infer the -1 dimension of {dims}: {total} values are not a multiple "
                                f"of {known}")
            top[top.index(None)] = total // known
        if count(top) != total:
            raise self.fail(f"shape {dims} gives a top of {tuple(top)} ({count(top)} values) for a bottom of "
                            f"{shape} ({total} values)")
        return [tuple(int(d) for d in top)]


@register("Tile")
class Tile(Layer):
    """Repeat the bottom `tiles` times along `axis` (each copy holds everything from the axis on)."""

    def setup(self, bottom_shapes):
        p = self.param.tile_param
        shape = bottom_shapes[0]
        self.axis = canonical_axis(p.axis, len(shape), self)
        self.tiles = int(p.tiles)
        if self.tiles < 1:
            raise self.fail(f"tile_param.tiles must be 1 or more, got {self.tiles}")
        self.outer = count(shape, 0, self.axis)
        self.inner = count(shape, self.axis)
        return [shape[:self.axis] + (shape[self.axis] * self.tiles,) + shape[self.axis + 1:]]

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        self.ops.tile_forward(bottom[0], top[0], self.outer, self.tiles, self.inner)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.tile_backward(top_diff[0], bottom_diff[0], self.outer, self.tiles, self.inner)


@register("Silence")
class Silence(Layer):
    """Consumes blobs so they are not reported as outputs; no tops. Its bottoms get no gradient (zero)."""

    has_backward = False
    n_bottoms = (1, None)
    n_tops = (0, 0)

    def setup(self, bottom_shapes):
        return []

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        pass

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        for pd, diff in zip(propagate_down, bottom_diff):
            if pd:
                self.ops.fill(diff, 0.0)
