"""DataTransformer: Caffe's per-image preprocessing, on the host, from transform_param.

For each (C, H, W) image, in Caffe's order: take the crop window (random in TRAIN, centred in
TEST), subtract the mean (mean_file image at the same pixel positions, or mean_value per channel),
multiply by `scale`, and flip left-right with probability 1/2 when `mirror` is set (TRAIN only).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from superneurons.errors import UserError
from superneurons.io.binaryproto import read_mean
from superneurons.proto import superneurons_pb2 as pb

# Fields older prototxts put in data_param / image_data_param; Caffe's upgrader moves them to transform_param.
_LEGACY_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def effective_transform_param(layer: pb.LayerParameter, legacy: object) -> pb.TransformationParameter:
    """transform_param, completed by any legacy field set in `legacy` (a data_param-like message)."""
    tp = pb.TransformationParameter()
    tp.CopyFrom(layer.transform_param)
    for name in _LEGACY_FIELDS:
        if legacy.HasField(name) and not tp.HasField(name):
            setattr(tp, name, getattr(legacy, name))
    if getattr(legacy, "force_encoded_color", False) and not tp.HasField("force_color"):
        tp.force_color = True
    return tp


class DataTransformer:
    def __init__(self, param: pb.TransformationParameter, train: bool, where: str):
        self.where = where
        self.scale = np.float32(param.scale)
        self.crop = int(param.crop_size)
        self.mirror = bool(param.mirror) and train  # TEST never mirrors
        self.train = train
        self.force_color = bool(param.force_color)
        self.force_gray = bool(param.force_gray)
        if self.force_color and self.force_gray:
            raise UserError(f"{where}: transform_param sets both force_color and force_gray")
        if param.mean_file and len(param.mean_value):
            raise UserError(f"{where}: transform_param sets both mean_file and mean_value; use one")
        self.mean_image = read_mean(param.mean_file) if param.mean_file else None
        self.mean_values = np.asarray(param.mean_value, dtype=np.float32)

    @property
    def uses_rng(self) -> bool:
        return self.mirror or (self.train and self.crop > 0)

    def out_shape(self, in_shape: Sequence[int]) -> tuple[int, int, int]:
        """The transformed shape of a (C, H, W) image; raises if the settings do not fit the image."""
        c, h, w = (int(d) for d in in_shape)
        if self.crop and (self.crop > h or self.crop > w):
            raise UserError(f"{self.where}: crop_size {self.crop} is larger than the {h}x{w} image")
        if self.mean_image is not None and self.mean_image.shape != (c, h, w):
            raise UserError(f"{self.where}: mean_file image has shape {_fmt(self.mean_image.shape)}, "
                            f"the data has {_fmt((c, h, w))}; they must match")
        if len(self.mean_values) not in (0, 1, c):
            raise UserError(f"{self.where}: {len(self.mean_values)} mean_value entries for {c} channels "
                            f"(give 1 or {c})")
        return (c, self.crop, self.crop) if self.crop else (c, h, w)

    def __call__(self, image: np.ndarray, rng: np.random.Generator | None, out: np.ndarray) -> None:
        """Transform one (C, H, W) image into `out` (float32, shape `out_shape(image.shape)`)."""
        c, h, w = image.shape
        flip = self.mirror and bool(rng.integers(2))
        y0, x0 = 0, 0
        if self.crop:
            if self.train:
                y0 = int(rng.integers(h - self.crop + 1))
                x0 = int(rng.integers(w - self.crop + 1))
            else:
                y0, x0 = (h - self.crop) // 2, (w - self.crop) // 2
        oh, ow = out.shape[1:]
        window = (slice(None), slice(y0, y0 + oh), slice(x0, x0 + ow))
        np.subtract(image[window], self._mean(c, window), out=out, dtype=np.float32)
        if self.scale != 1:
            out *= self.scale
        if flip:
            out[...] = out[:, :, ::-1].copy()

    def _mean(self, channels: int, window: tuple[slice, ...]) -> np.ndarray | np.float32:
        if self.mean_image is not None:
            return self.mean_image[window]
        if len(self.mean_values) == 1:
            return self.mean_values[0]
        if len(self.mean_values):
            return self.mean_values.reshape(channels, 1, 1)
        return np.float32(0)


def _fmt(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)
