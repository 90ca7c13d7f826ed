"""Caffe's files (prototxt, caffemodel, solverstate, binaryproto); also pycaffe's `caffe.io` names
(Transformer, load_image, array_to_datum, ...), which load from superneurons.pycaffe.io on first use."""


def __getattr__(name: str):
    from superneurons.pycaffe import io as pycaffe_io

    if name.startswith("_") or name not in pycaffe_io.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(pycaffe_io, name)
