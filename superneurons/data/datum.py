"""Caffe's `Datum` record <-> a (C, H, W) NumPy array, and image files <-> arrays.

Channel order follows Caffe, which reads images with OpenCV: colour images are stored and decoded
as BGR, so a database written by Caffe's convert_imageset and one written here hold the same bytes.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from superneurons.errors import UserError, reason
from superneurons.proto import superneurons_pb2 as pb

# What Pillow raises for image bytes it cannot decode: OSError/SyntaxError for truncated or unknown data,
# EOFError/ValueError from some plugins on malformed headers, DecompressionBombError for a header claiming
# more pixels than Image.MAX_IMAGE_PIXELS (a damaged size field would otherwise try to allocate them).
_UNDECODABLE = (OSError, SyntaxError, EOFError, ValueError, Image.DecompressionBombError)

# Pillow modes that OpenCV's "keep the file's colour type" decode would give one channel for.
_GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


def parse_datum(value: bytes, where: str) -> pb.Datum:
    datum = pb.Datum()
    try:
        datum.ParseFromString(value)
    except Exception as e:  # protobuf raises DecodeError, but a corrupt record can surface differently
        raise UserError(f"{where}: not a serialized Caffe Datum ({e})") from None
    return datum


def datum_to_array(datum: pb.Datum, where: str, force_color: bool = False, force_gray: bool = False) -> np.ndarray:
    """The record's pixels as (C, H, W): uint8 for byte data and images, float32 for float_data."""
    if datum.encoded:
        return decode_image(datum.data, where, force_color, force_gray)
    c, h, w = datum.channels, datum.height, datum.width
    if min(c, h, w) < 1:  # the fields are signed on the wire; a damaged record can say anything
        raise UserError(f"{where}: Datum has channels {c}, height {h}, width {w}; each must be at least 1")
    n = c * h * w
    if datum.data:
        if len(datum.data) != n:
            raise UserError(f"{where}: Datum says {c}x{h}x{w} = {n} values but holds {len(datum.data)} bytes")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(c, h, w)
    if len(datum.float_data) != n:
        raise UserError(f"{where}: Datum says {c}x{h}x{w} = {n} values but holds {len(datum.float_data)} floats")
    return np.asarray(datum.float_data, dtype=np.float32).reshape(c, h, w)


def array_to_datum(array: np.ndarray, label: int = 0) -> pb.Datum:
    """A (C, H, W) uint8 array becomes byte data, anything else float_data (as Caffe's array-to-datum does)."""
    if array.ndim != 3:
        raise ValueError(f"expected a (C, H, W) array, got shape {array.shape}")
    c, h, w = array.shape
    datum = pb.Datum(channels=c, height=h, width=w, label=int(label))
    if array.dtype == np.uint8:
        datum.data = np.ascontiguousarray(array).tobytes()
    else:
        datum.float_data.extend(np.asarray(array, dtype=np.float32).ravel().tolist())
    return datum


def encoded_datum(image_bytes: bytes, label: int = 0) -> pb.Datum:
    """A record holding a compressed image file as is (Caffe leaves channels/height/width unset)."""
    return pb.Datum(data=image_bytes, label=int(label), encoded=True)


# ---- images ------------------------------------------------------------------------------------
def pil_to_array(img: Image.Image, force_color: bool = False, force_gray: bool = False) -> np.ndarray:
    """A Pillow image as (C, H, W) uint8: gray -> 1 channel, colour -> 3 channels in BGR order."""
    gray = force_gray or (not force_color and img.mode in _GRAY_MODES)
    if gray:
        return np.asarray(img.convert("L"), dtype=np.uint8)[None]
    rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return np.ascontiguousarray(rgb[:, :, ::-1].transpose(2, 0, 1))


def array_to_pil(array: np.ndarray) -> Image.Image:
    """The inverse of `pil_to_array` for (1, H, W) or (3, H, W) BGR uint8 arrays."""
    if array.shape[0] == 1:
        return Image.fromarray(np.ascontiguousarray(array[0]), mode="L")
    if array.shape[0] == 3:
        return Image.fromarray(np.ascontiguousarray(array[::-1].transpose(1, 2, 0)), mode="RGB")
    raise ValueError(f"an image needs 1 or 3 channels, got {array.shape[0]}")


def decode_image(data: bytes, where: str, force_color: bool = False, force_gray: bool = False) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data)) as img:
            return pil_to_array(img, force_color, force_gray)
    except _UNDECODABLE as e:
        raise UserError(f"{where}: cannot decode the encoded image ({reason(e)})") from None


def encode_image(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    array_to_pil(array).save(buf, format=fmt)
    return buf.getvalue()


def load_image(path: str, is_color: bool = True, height: int = 0, width: int = 0) -> np.ndarray:
    """Read an image file as (C, H, W) uint8, resized (bilinear) when height and width are given."""
    most = Image.MAX_IMAGE_PIXELS or 1 << 31  # the decoder's own limit applies to the resize target too
    if height > 0 and width > 0 and height * width > most:
        raise UserError(f"{path}: resizing to {height}x{width} asks for {height * width} pixels, more than "
                        f"the {most} an image may have")
    try:
        with Image.open(path) as img:
            img = img.convert("RGB" if is_color else "L")
            if height > 0 and width > 0 and img.size != (width, height):
                img = img.resize((width, height), Image.BILINEAR)
            return pil_to_array(img, force_color=is_color, force_gray=not is_color)
    except FileNotFoundError:
        raise UserError(f"{path}: no such image file") from None
    except _UNDECODABLE as e:
        raise UserError(f"{path}: cannot read the image ({reason(e)})") from None
