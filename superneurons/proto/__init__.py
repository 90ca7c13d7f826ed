

def __getattr__(name: str):
    """`caffe.proto.caffe_pb2` without importing it first, as pycaffe's package gives it."""
    if name == "caffe_pb2":
        import importlib

        return importlib.import_module("superneurons.proto.caffe_pb2")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
