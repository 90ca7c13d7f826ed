"""WindowData: R-CNN's window file input (Caffe's layer; `superneurons.data.windows` has the file format and
how windows are sampled and warped). Tops: the warped windows (batch_size, 3, crop_size, crop_size) and
their classes (batch_size,), 0 for background.

Caffe takes crop_size, mirror and mean_file/mean_value from transform_param (older prototxts put crop_size,
mirror and mean_file in window_data_param, which still counts) and scale from window_data_param. The
windows are made by the same machinery as Data's batches (decode workers or a prefetch thread, batch k a
pure function of k, resumable position); the warp does the whole preprocessing, so the layer's transformer
passes them through.
"""
from __future__ import annotations

from superneurons.data.transformer import DataTransformer, effective_transform_param
from superneurons.data.windows import CHANNELS, WindowRecords, WindowSettings
from superneurons.io.binaryproto import read_mean
from superneurons.layers.base import register
from superneurons.layers.data import PrefetchingDataLayer
from superneurons.proto import superneurons_pb2 as pb


@register("WindowData")
class WindowData(PrefetchingDataLayer):
    def open_source(self):
        p = self.param.window_data_param
        if not p.source:
            raise self.fail("window_data_param.source is required (an R-CNN window file)")
        self.batch_size = int(p.batch_size)
        if self.batch_size < 1:
            raise self.fail(f"window_data_param.batch_size must be at least 1, got {self.batch_size}")
        if not 0 <= p.fg_fraction <= 1:
            raise self.fail(f"window_data_param.fg_fraction must be in [0, 1], got {p.fg_fraction:g}")
        if p.crop_mode not in ("warp", "square"):
            raise self.fail(f"window_data_param.crop_mode must be \"warp\" or \"square\", got {p.crop_mode!r}")
        tp = effective_transform_param(self.param, p)
        if tp.crop_size < 1:
            raise self.fail("needs a crop_size of 1 or more (transform_param.crop_size): the windows are warped "
                            "to crop_size x crop_size")
        if 2 * p.context_pad >= tp.crop_size:
            raise self.fail(f"context_pad {p.context_pad} leaves nothing of a {tp.crop_size}-pixel crop")
        if tp.mean_file and len(tp.mean_value):
            raise self.fail("transform_param sets both mean_file and mean_value; use one")
        if len(tp.mean_value) not in (0, 1, CHANNELS):
            raise self.fail(f"give 1 mean_value or one per channel ({CHANNELS}), got {len(tp.mean_value)}")
        mean_image = read_mean(tp.mean_file) if tp.mean_file else None
        if mean_image is not None and (mean_image.shape[0] != CHANNELS or min(mean_image.shape[1:]) < tp.crop_size):
            raise self.fail(f"mean_file {tp.mean_file!r} is {'x'.join(map(str, mean_image.shape))}; it needs "
                            f"{CHANNELS} channels of at least {tp.crop_size} x {tp.crop_size}")
        means = tuple(tp.mean_value) * (CHANNELS if len(tp.mean_value) == 1 else 1)
        settings = WindowSettings(self.batch_size, float(p.fg_fraction), int(tp.crop_size), int(p.context_pad),
                                  p.crop_mode == "square", bool(tp.mirror), float(p.scale), mean_image, means)
        root = p.root_folder
        return WindowRecords(p.source, root, p.fg_threshold, p.bg_threshold, settings, self.where), p

    def _first_item_shape(self, legacy):
        self.transformer = DataTransformer(pb.TransformationParameter(), self.phase == pb.TRAIN, self.where)
        size = self._pipe.source.settings.crop_size
        return (CHANNELS, size, size)
