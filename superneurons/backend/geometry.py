"""Small frozen descriptions of a windowed op, shared by every backend.

Layers build these once in `setup` and pass them to the ops; the CPU backend reads the fields
directly and the CUDA backend maps them onto cuDNN descriptors (convolution, pooling and LRN
descriptors take exactly these numbers). Output sizes are not stored: an op reads them from
the output array it is given, so one geometry serves any batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

Pair = tuple[int, int]


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution over NCHW arrays; weights are (M, C / group, kh, kw)."""

    kernel: Pair
    stride: Pair = (1, 1)
    pad: Pair = (0, 0)
    dilation: Pair = (1, 1)
    group: int = 1

    def extent(self) -> Pair:
        """How many input rows/columns one kernel application spans (dilation spreads the taps)."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))  # type: ignore[return-value]

    def out_size(self, in_hw: Pair) -> Pair:
        return tuple((n + 2 * p - e) // s + 1  # type: ignore[return-value]
                     for n, p, e, s in zip(in_hw, self.pad, self.extent(), self.stride))


@dataclass(frozen=True)
class PoolGeometry:
    """A 2-D pooling window; `method` is "max", "ave" or "stochastic" (TEST-time weighted average)."""

    method: str
    kernel: Pair
    stride: Pair = (1, 1)
    pad: Pair = (0, 0)


@dataclass(frozen=True)
class LRNGeometry:
    """Local response normalization, Caffe's parameters: y = x * (shift + coeff * window_sum(x^2)) ** -beta.

    `across` sums over `size` neighbouring channels, otherwise over a size x size spatial window,
    zero-padded by (size - 1) / 2 on each side (size is odd).
    """

    across: bool
    size: int
    alpha: float
    beta: float
    k: float

    @property
    def shift(self) -> float:
        # Caffe builds WITHIN_CHANNEL from an average pooling and a Power layer with shift 1: `k` is unused there.
        return self.k if self.across else 1.0

    @property
    def coeff(self) -> float:
        # alpha is spread over the window: / size across channels, / size^2 within a channel (the average).
        return self.alpha / (self.size if self.across else self.size * self.size)


def check_signed_mask(signed_mask: bool, top_mask) -> None:
    """A signed max-pooling mask (the pooling runs its ReLU's backward, graph/fuse.py) is never Caffe's mask top,
    which holds the plain argmax: the fusion skips poolings with that top."""
    if signed_mask and top_mask is not None:
        raise ValueError("a signed max-pooling mask cannot also be the layer's mask top")
