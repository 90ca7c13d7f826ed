"""pycaffe's `Classifier`: a deploy Net that takes H x W x K images and returns class scores.

Each image is resized to `image_dims`, then either cut into ten crops (`oversample`, the scores of the ten
averaged) or centre-cropped to the net's input, preprocessed by the Transformer (transpose to K x H x W,
channel swap, raw_scale, mean, input_scale) and run through the net in batches.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from superneurons.errors import UserError
from superneurons.pycaffe import io
from superneurons.pycaffe.net import TEST, Net


class Classifier(Net):
    def __init__(self, model_file: str, pretrained_file: str, image_dims: Sequence[int] | None = None,
                 mean: np.ndarray | None = None, input_scale: float | None = None, raw_scale: float | None = None,
                 channel_swap: Sequence[int] | None = None, **net_options):
        super().__init__(model_file, pretrained_file, TEST, **net_options)
        if not self.inputs:
            raise UserError(f"{model_file}: Classifier needs a deploy net with an Input layer")
        in_ = self.inputs[0]
        self.transformer = io.Transformer({in_: self.blobs[in_].shape})
        self.transformer.set_transpose(in_, (2, 0, 1))
        if mean is not None:
            self.transformer.set_mean(in_, mean)
        if input_scale is not None:
            self.transformer.set_input_scale(in_, input_scale)
        if raw_scale is not None:
            self.transformer.set_raw_scale(in_, raw_scale)
        if channel_swap is not None:
            self.transformer.set_channel_swap(in_, channel_swap)
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
