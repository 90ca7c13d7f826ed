"""pycaffe's `Classifier` (a deploy Net that takes H x W x K images and returns class scores) and
`Detector` (the same for windows of images, R-CNN style).

Each image is resized to `image_dims`, then either cut into ten crops (`oversample`, the scores of the ten
averaged) or centre-cropped to the net's input, preprocessed by the Transformer (transpose to K x H x W,
channel swap, raw_scale, mean, input_scale) and run through the net in batches.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from superneurons.errors import UserError
from superneurons.io import caffe_io as io
from superneurons.pycaffe.net import TEST, Net


def _transformer(net: Net, mean: np.ndarray | None, input_scale: float | None, raw_scale: float | None,
                 channel_swap: Sequence[int] | None) -> io.Transformer:
    """The Transformer of pycaffe's Classifier and Detector for the net's first input: H x W x K images in,
    K x H x W out, with whichever of the four settings were given."""
    in_ = net.inputs[0]
    transformer = io.Transformer({in_: net.blobs[in_].shape})
    transformer.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(in_, mean)
    if input_scale is not None:
        transformer.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(in_, channel_swap)
    return transformer


class Classifier(Net):
    def __init__(self, model_file: str, pretrained_file: str, image_dims: Sequence[int] | None = None,
                 mean: np.ndarray | None = None, input_scale: float | None = None, raw_scale: float | None = None,
                 channel_swap: Sequence[int] | None = None, **net_options):
        super().__init__(model_file, pretrained_file, TEST, **net_options)
        if not self.inputs:
            raise UserError(f"{model_file}: Classifier needs a deploy net with an Input layer")
        in_ = self.inputs[0]
        self.transformer = _transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].shape[2:])
        self.image_dims = np.array(image_dims if image_dims is not None and len(image_dims) else self.crop_dims)

    def predict(self, inputs: Sequence[np.ndarray], oversample: bool = True) -> np.ndarray:
        """Scores (N x classes) of the H x W x K images `inputs`."""
        inputs = list(inputs)
        if not inputs:
            raise UserError("Classifier.predict: no images given")
        h, w = (int(d) for d in self.image_dims)
        resized = np.zeros((len(inputs), h, w, inputs[0].shape[2]), dtype=np.float32)
        for i, image in enumerate(inputs):
            resized[i] = io.resize_image(image, (h, w))
        if oversample:
            crops = io.oversample(resized, self.crop_dims)
        else:
            centre = np.array([h, w]) / 2.0
            box = np.concatenate([centre - self.crop_dims / 2.0, centre + self.crop_dims / 2.0]).astype(int)
            crops = resized[:, box[0]:box[2], box[1]:box[3], :]
        in_ = self.inputs[0]
        batch = np.stack([self.transformer.preprocess(in_, crop) for crop in crops])
        scores = self.forward_all(**{in_: batch})[self.outputs[0]]
        if oversample:
            scores = scores.reshape((len(scores) // 10, 10, -1)).mean(axis=1)
        return scores


class Detector(Net):
    """pycaffe's `Detector`: scores windows of images (R-CNN style) with a deploy net.

    Each window (ymin, xmin, ymax, xmax) is cut from its image, with `context_pad` pixels of surrounding
    context at the input's scale when given (what falls outside the image is filled with the mean), resized
    to the net's input and preprocessed like Classifier's images. `detect_windows` returns, per window, a
    dict with its `window`, `prediction` (the first output's scores) and `filename`."""

    def __init__(self, model_file: str, pretrained_file: str, mean: np.ndarray | None = None,
                 input_scale: float | None = None, raw_scale: float | None = None,
                 channel_swap: Sequence[int] | None = None, context_pad: int | None = None, **net_options):
        super().__init__(model_file, pretrained_file, TEST, **net_options)
        if not self.inputs:
            raise UserError(f"{model_file}: Detector needs a deploy net with an Input layer")
        self.transformer = _transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def configure_crop(self, context_pad: int | None) -> None:
        """The crop's H x W x K and, with context padding, the mean image in the images' own terms (H x W x K,
        original channel order, before raw_scale) to fill what lies outside an image."""
        in_ = self.inputs[0]
        _, channels, height, width = self.blobs[in_].shape
        self.crop_dims = np.array((height, width, channels))
        self.context_pad = context_pad
        self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
        mean = self.transformer.mean.get(in_)
        if context_pad and mean is not None:
            crop_mean = np.broadcast_to(mean, (channels, height, width)).transpose(1, 2, 0).copy()
            swap = self.transformer.channel_swap.get(in_)
            if swap is not None:
                crop_mean = crop_mean[:, :, np.argsort(swap)]
            raw_scale = self.transformer.raw_scale.get(in_)
            if raw_scale is not None:
                crop_mean /= raw_scale
            self.crop_mean = crop_mean.astype(np.float32)

    def crop(self, im: np.ndarray, window: Sequence[int]) -> np.ndarray:
        """The window of `im` (H x W x K), with context padding when configured."""
        y0, x0, y1, x1 = (int(v) for v in window)
        if not self.context_pad:
            return im[y0:y1, x0:x1]
        size = int(self.crop_dims[1])  # a square input, as in R-CNN
        scale = size / (size - 2.0 * self.context_pad)
        half_h, half_w = (y1 - y0 + 1) / 2.0, (x1 - x0 + 1) / 2.0
        centre = np.array((y0 + half_h, x0 + half_w, y0 + half_h, x0 + half_w))
        box = np.round(centre + scale * np.array((-half_h, -half_w, half_h, half_w)))
        scale_h, scale_w = size / (box[2] - box[0] + 1), size / (box[3] - box[1] + 1)
        pad_y, pad_x = int(round(max(0.0, -box[0]) * scale_h)), int(round(max(0.0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0, [im_h, im_w, im_h, im_w])
        crop_h = min(int(round((box[2] - box[0] + 1) * scale_h)), size - pad_y)
        crop_w = min(int(round((box[3] - box[1] + 1) * scale_w)), size - pad_x)
        context = im[int(box[0]):int(box[2]), int(box[1]):int(box[3])]
        if context.size == 0 or crop_h < 1 or crop_w < 1:
            raise UserError(f"Detector: window {tuple(window)} lies outside the {im_h} x {im_w} image")
        out = self.crop_mean.copy()
        out[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = io.resize_image(context, (crop_h, crop_w))
        return out

    def detect_windows(self, images_windows: Sequence[tuple[str, Sequence[Sequence[int]]]]) -> list[dict]:
        """`images_windows`: (image file, windows) pairs; returns one dict per window, in order."""
        crops = []
        for filename, windows in images_windows:
            image = io.load_image(filename)
            crops.extend(self.crop(image, window) for window in windows)
        if not crops:
            return []
        in_ = self.inputs[0]
        batch = np.stack([self.transformer.preprocess(in_, c) for c in crops])
        scores = self.forward_all(**{in_: batch})[self.outputs[0]]
        flat = [(filename, window) for filename, windows in images_windows for window in windows]
        return [{"window": window, "prediction": scores[i], "filename": filename}
                for i, (filename, window) in enumerate(flat)]
