"""Caffe's files (prototxt, caffemodel, solverstate, binaryproto); also pycaffe's `caffe.io` names
(Transformer, load_image, array_to_datum, ...), which load from `caffe_io.py` on first use."""


def __getattr__(name: str):
    import importlib.util

    # The import system asks here first for a submodule not yet loaded (`from superneurons.io import
    # prototxt`): those are left to it, without loading the image and array helpers.
    if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from superneurons.io import caffe_io

    if name not in caffe_io.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(caffe_io, name)
