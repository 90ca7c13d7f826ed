"""Caffe's compute_image_mean: the mean (C, H, W) image of a database of Datum records."""
from __future__ import annotations

import numpy as np

from superneurons.data.datum import datum_to_array, parse_datum
from superneurons.data.databases import open_reader
from superneurons.errors import UserError


def compute_mean(path: str, backend: str | None, where: str = "compute_image_mean") -> np.ndarray:
    """The float64-accumulated mean of every record (encoded images decoded); every record must have the
    first one's shape. `backend` None reads whichever store the folder holds."""
    reader = open_reader(path, backend, where)
    try:
        total = None
        values = reader.values_from(0)
        try:
            for number in range(reader.count):
                at = f"{path}: record {number}"
                pixels = datum_to_array(parse_datum(next(values), at), at)
                if total is None:
                    total = np.zeros(pixels.shape, dtype=np.float64)
                elif pixels.shape != total.shape:
                    raise UserError(f"{at}: shape {pixels.shape} differs from the first record's {total.shape}")
                total += pixels
        finally:
            values.close()
        return (total / reader.count).astype(np.float32)
    finally:
        reader.close()
