"""pycaffe's `caffe.io`: image loading and resizing, the input Transformer, and NumPy <-> Caffe proto records.

Behaviour follows pycaffe's io.py: images are H x W x K floats in [0, 1] (RGB); `Transformer.preprocess`
resizes to the input's H x W, transposes, swaps channels, scales, subtracts the mean and scales again;
`oversample` takes the 4 corner crops and the centre crop, then their mirror images.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from superneurons.errors import UserError, UserValueError, reason
from superneurons.proto import superneurons_pb2 as pb

__all__ = ["Transformer", "load_image", "resize_image", "oversample", "array_to_datum", "datum_to_array",
           "blobproto_to_array", "array_to_blobproto", "arraylist_to_blobprotovector_str",
           "blobprotovector_str_to_arraylist"]


# -- images --------------------------------------------------------------------------------------------


def load_image(filename: str, color: bool = True) -> np.ndarray:
    """An image file as H x W x 3 float32 RGB in [0, 1] (`color=False`: H x W x 1 gray)."""
    from PIL import Image, UnidentifiedImageError  # Pillow loads only when an image is read

    path = str(filename)
    try:
        with Image.open(path) as im:
            pixels = im.convert("RGB" if color else "L")
    except FileNotFoundError:
        raise UserError(f"{path}: no such image file") from None
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{path}: cannot read it as an image ({reason(e)})") from None
    img = np.asarray(pixels, dtype=np.float32) / 255.0
    return img if color else img[:, :, None]


def resize_image(im: np.ndarray, new_dims: Sequence[int], interp_order: int = 1) -> np.ndarray:
    """Resize an H x W x K image to new_dims (H', W') with spline order `interp_order` (1: bilinear).

    As pycaffe, which calls scikit-image's resize on images of 1 or 3 channels: the image is scaled to
    [0, 1], smoothed with a Gaussian of sigma (factor - 1) / 2 along each axis it shrinks (anti-aliasing),
    sampled at pixel centres with zeros outside (`mode='constant'`), clipped to [0, 1] and scaled back; a
    constant image stays constant. Other channel counts are zoomed with the corners aligned (scipy's zoom,
    as pycaffe). Order 1 is computed here; other orders need SciPy.
    """
    im = np.asarray(im, dtype=np.float64)
    if im.ndim != 3:
        raise UserError(f"resize_image: expected an H x W x K image, got shape {im.shape}")
    out = (int(new_dims[0]), int(new_dims[1]))
    if min(out) < 1:
        raise UserError(f"resize_image: cannot resize to {out}")
    if im.shape[-1] in (1, 3):
        lo, hi = float(im.min()), float(im.max())
        if hi <= lo:
            return np.full(out + (im.shape[-1],), lo, dtype=np.float32)
        unit = (im - lo) / (hi - lo)
        for axis in (0, 1):
            factor = im.shape[axis] / out[axis]
            if factor > 1:
                unit = _gaussian_smooth(unit, axis, (factor - 1) / 2)
        zoomed = _zoom(unit, out, interp_order, centres=True)
        resized = np.clip(zoomed, 0.0, 1.0) * (hi - lo) + lo
    else:
        resized = _zoom(im, out, interp_order, centres=False)
    return resized.astype(np.float32)


def _gaussian_smooth(a: np.ndarray, axis: int, sigma: float) -> np.ndarray:
    """A Gaussian filter along `axis` with zeros beyond the border (scipy.ndimage's, truncated at 4 sigma)."""
    radius = int(4.0 * sigma + 0.5)
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    pad = [(0, 0)] * a.ndim
    pad[axis] = (radius, radius)
    padded = np.pad(a, pad)
    n = a.shape[axis]
    return sum(w * np.take(padded, np.arange(j, j + n), axis=axis) for j, w in enumerate(taps))


def _zoom(a: np.ndarray, out: tuple[int, int], order: int, centres: bool) -> np.ndarray:
    """Resample the first two axes to `out`: `centres` maps pixel centres (zeros outside the image),
    else the corner pixels onto each other."""
    if order != 1:
        try:
            from scipy import ndimage
        except ImportError:
            raise UserError(f"resize_image with interp_order={order} needs SciPy (pip install scipy); "
                            "order 1 does not") from None
        factors = (out[0] / a.shape[0], out[1] / a.shape[1], 1.0)
        if centres:
            return ndimage.zoom(a, factors, order=order, mode="grid-constant", cval=0.0, grid_mode=True)
        return ndimage.zoom(a, factors, order=order)
    for axis in (0, 1):
        n_in, n_out = a.shape[axis], out[axis]
        if centres:
            pos = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        else:
            pos = np.arange(n_out) * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(1)
        left = np.floor(pos).astype(np.int64)
        frac = (pos - left).reshape((-1,) + (1,) * (a.ndim - 1 - axis))
        padded = np.pad(a, [(1, 2) if k == axis else (0, 0) for k in range(a.ndim)])  # zeros beyond each edge
        lo = np.take(padded, np.clip(left, -1, n_in) + 1, axis=axis)
        hi = np.take(padded, np.clip(left + 1, -1, n_in) + 1, axis=axis)
        a = (1 - frac) * lo + frac * hi
    return a


def oversample(images: Sequence[np.ndarray], crop_dims: Sequence[int]) -> np.ndarray:
    """Ten crops of each H x W x K image: the four corners and the centre, then the same five mirrored
    left to right; (10 * len(images), crop H, crop W, K)."""
    images = list(images)
    h, w = images[0].shape[:2]
    ch, cw = (int(d) for d in crop_dims[:2])
    if ch > h or cw > w:
        raise UserError(f"oversample: crop {ch} x {cw} is larger than the image {h} x {w}")
    corners = [(top, left) for top in (0, h - ch) for left in (0, w - cw)]
    centre = (int(h / 2.0 - ch / 2.0), int(w / 2.0 - cw / 2.0))
    boxes = corners + [centre]
    crops = np.empty((10 * len(images), ch, cw, images[0].shape[-1]), dtype=np.float32)
    for i, im in enumerate(images):
        five = [im[top:top + ch, left:left + cw, :] for top, left in boxes]
        crops[10 * i:10 * i + 5] = five
        crops[10 * i + 5:10 * i + 10] = [c[:, ::-1, :] for c in five]
    return crops


# -- the Transformer -------------------------------------------------------------------------------------


class Transformer:
    """Turns images (H x W x K, [0, 1]) into a net's input (K x H x W) and back, per input blob.

    `inputs`: {blob name: its shape}, e.g. `{'data': net.blobs['data'].data.shape}`."""

    def __init__(self, inputs: dict[str, Sequence[int]]):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose: dict[str, tuple[int, ...]] = {}
        self.channel_swap: dict[str, tuple[int, ...]] = {}
        self.raw_scale: dict[str, float] = {}
        self.mean: dict[str, np.ndarray] = {}
        self.input_scale: dict[str, float] = {}

    def _check(self, in_: str) -> None:
        if in_ not in self.inputs:
            raise UserError(f"Transformer: {in_!r} is not one of the net inputs: {', '.join(self.inputs)}")

    def preprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """resize to the input's H x W, transpose, swap channels, * raw_scale, - mean, * input_scale."""
        self._check(in_)
        x = np.asarray(data).astype(np.float32, copy=False)
        in_dims = self.inputs[in_][2:]
        if x.shape[:2] != tuple(in_dims):
            x = resize_image(x, in_dims)
        if in_ in self.transpose:
            x = x.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            x = x[list(self.channel_swap[in_]), :, :]
        if in_ in self.raw_scale:
            x = x * np.float32(self.raw_scale[in_])
        if in_ in self.mean:
            x = x - self.mean[in_]
        if in_ in self.input_scale:
            x = x * np.float32(self.input_scale[in_])
        return np.asarray(x, dtype=np.float32)

    def deprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """The inverse of preprocess except for the resize (for looking at inputs)."""
        self._check(in_)
        x = np.array(data, dtype=np.float32).squeeze()
        if in_ in self.input_scale:
            x /= self.input_scale[in_]
        if in_ in self.mean:
            x += self.mean[in_]
        if in_ in self.raw_scale:
            x /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            x = x[np.argsort(self.channel_swap[in_]), :, :]
        if in_ in self.transpose:
            x = x.transpose(np.argsort(self.transpose[in_]))
        return x

    def set_transpose(self, in_: str, order: Sequence[int]) -> None:
        """e.g. (2, 0, 1): H x W x K images to K x H x W."""
        self._check(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise UserError(f"Transformer.set_transpose({in_!r}, {tuple(order)}): the order needs one entry per "
                            f"axis of an item of the input ({len(self.inputs[in_]) - 1})")
        self.transpose[in_] = tuple(int(o) for o in order)

    def set_channel_swap(self, in_: str, order: Sequence[int]) -> None:
        """e.g. (2, 1, 0): RGB to BGR, the order Caffe's models were trained in."""
        self._check(in_)
        if len(order) != self.inputs[in_][1]:
            raise UserError(f"Transformer.set_channel_swap({in_!r}, {tuple(order)}): the input has "
                            f"{self.inputs[in_][1]} channels")
        self.channel_swap[in_] = tuple(int(o) for o in order)

    def set_raw_scale(self, in_: str, scale: float) -> None:
        """e.g. 255: [0, 1] images to [0, 255], the range Caffe's mean files are in."""
        self._check(in_)
        self.raw_scale[in_] = float(scale)

    def set_mean(self, in_: str, mean: np.ndarray) -> None:
        """A per-channel mean (K values) or a mean image (K x H x W, or H x W for one channel)."""
        self._check(in_)
        mean = np.asarray(mean, dtype=np.float32)
        shape = self.inputs[in_]
        if mean.ndim == 1:
            if mean.shape[0] != shape[1]:
                raise UserValueError(f"Transformer.set_mean({in_!r}): {mean.shape[0]} mean values for "
                                f"{shape[1]} channels")
            mean = mean[:, None, None]
        else:
            ms = (1,) + mean.shape if mean.ndim == 2 else mean.shape
            if len(ms) != 3:
                raise UserValueError(f"Transformer.set_mean({in_!r}): a mean of shape {mean.shape}; give K values "
                                "or a K x H x W image")
            if ms != shape[1:]:
                raise UserValueError(f"Transformer.set_mean({in_!r}): mean shape {ms} differs from the input's "
                                f"{shape[1:]}")
            mean = mean.reshape(ms)
        self.mean[in_] = mean

    def set_input_scale(self, in_: str, scale: float) -> None:
        """Multiply after subtracting the mean (e.g. 0.017 for MobileNet)."""
        self._check(in_)
        self.input_scale[in_] = float(scale)


# -- proto records ---------------------------------------------------------------------------------------


def blobproto_to_array(blob: Any, return_diff: bool = False) -> np.ndarray:
    """A BlobProto's data (or diff) as an array of its shape: the legacy num/channels/height/width when set,
    else `shape`. float64, as pycaffe's."""
    values = np.array(blob.diff if return_diff else blob.data, dtype=np.float64)
    if blob.HasField("num") or blob.HasField("channels") or blob.HasField("height") or blob.HasField("width"):
        shape = (blob.num, blob.channels, blob.height, blob.width)
    else:
        shape = tuple(blob.shape.dim)
    if values.size != int(np.prod(shape, dtype=np.int64)):
        raise UserValueError(f"blobproto_to_array: the blob's shape {shape} needs {int(np.prod(shape))} values but "
                        f"it holds {values.size}")
    return values.reshape(shape)


def array_to_blobproto(arr: np.ndarray, diff: np.ndarray | None = None) -> pb.BlobProto:
    """A BlobProto with `shape` and data (and diff, of the same shape, when given)."""
    arr = np.asarray(arr)
    blob = pb.BlobProto()
    blob.shape.dim.extend(int(d) for d in arr.shape)
    blob.data.extend(arr.astype(float).ravel().tolist())
    if diff is not None:
        diff = np.asarray(diff)
        if diff.shape != arr.shape:
            raise UserValueError(f"array_to_blobproto: diff shape {diff.shape} differs from data shape {arr.shape}")
        blob.diff.extend(diff.astype(float).ravel().tolist())
    return blob


def arraylist_to_blobprotovector_str(arraylist: Sequence[np.ndarray]) -> bytes:
    """A serialized BlobProtoVector of the arrays."""
    vec = pb.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(a) for a in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(text: bytes) -> list[np.ndarray]:
    vec = pb.BlobProtoVector()
    vec.ParseFromString(text)
    return [blobproto_to_array(b) for b in vec.blobs]


def array_to_datum(arr: np.ndarray, label: int | None = None) -> pb.Datum:
    """A C x H x W array as a Datum: uint8 arrays as bytes, others as float_data."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise UserValueError(f"array_to_datum: expected a C x H x W array, got shape {arr.shape}")
    datum = pb.Datum(channels=arr.shape[0], height=arr.shape[1], width=arr.shape[2])
    if arr.dtype == np.uint8:
        datum.data = np.ascontiguousarray(arr).tobytes()
    else:
        datum.float_data.extend(arr.astype(float).ravel().tolist())
    if label is not None:
        datum.label = int(label)
    return datum


def datum_to_array(datum: Any) -> np.ndarray:
    """A (non-encoded) Datum's pixels as C x H x W: uint8 for byte data, float64 for float_data (pycaffe's)."""
    shape = (datum.channels, datum.height, datum.width)
    if datum.encoded:
        raise UserError("datum_to_array: the Datum holds an encoded image file; decode it (e.g. with PIL) instead")
    if len(datum.data):
        if len(datum.data) != int(np.prod(shape)):
            raise UserError(f"datum_to_array: Datum says {shape} but holds {len(datum.data)} bytes")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    values = np.array(datum.float_data, dtype=np.float64)
    if values.size != int(np.prod(shape)):
        raise UserError(f"datum_to_array: Datum says {shape} but holds {values.size} floats")
    return values.reshape(shape)
