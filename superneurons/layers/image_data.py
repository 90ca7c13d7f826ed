"""ImageData: images named in a list file (`path label` per line), read with Pillow.

Same machinery as Data (decode workers or a prefetch thread, DataTransformer, resumable position). With `shuffle`
each pass over the list uses its own permutation, seeded from the run seed and the pass number,
so the order is reproducible and a resumed run continues mid-pass exactly.
"""
from __future__ import annotations

import os

from superneurons.data.image_list import read_image_list
from superneurons.data.records import ImageListRecords
from superneurons.layers.base import register
from superneurons.layers.data import PrefetchingDataLayer


@register("ImageData")
class ImageData(PrefetchingDataLayer):
    def open_source(self):
        p = self.param.image_data_param
        if not p.source:
            raise self.fail("image_data_param.source is required (a list file of `path label` lines)")
        if (p.new_height > 0) != (p.new_width > 0):
            raise self.fail(f"set both new_height and new_width or neither (got {p.new_height}, {p.new_width})")
        self.batch_size = int(p.batch_size)
        self.rand_skip = int(p.rand_skip)
        self.workers_param = p
        entries = read_image_list(p.source, self.where)
        # Caffe prefixes names with root_folder as a plain string; keep that, but accept a folder without '/'.
        root = p.root_folder
        if root and not root.endswith(os.sep):
            root += os.sep
        source = ImageListRecords(entries, root, self.where, bool(p.shuffle), bool(p.is_color),
                                  int(p.new_height), int(p.new_width))
        return source, p
