"""Data input on the host: Datum records and LMDB, the DataTransformer, batches, the prefetch thread.

The layers that use these live in `superneurons.layers` (data.py, image_data.py, memory_data.py).
"""
