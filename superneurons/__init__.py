"""SuperNeurons: a Caffe-compatible training framework that trains networks larger than the GPU's memory.

`import superneurons as caffe` gives pycaffe's interface (Net, get_solver, io, NetSpec, ...; docs/PYTHON.md).
Those names load on first use, so importing the package (and the command line) stays cheap.
"""

__version__ = "0.1.0"

# pycaffe name -> (module, attribute or None for the module itself)
_PYCAFFE = {name: ("superneurons.pycaffe", name) for name in (
    "set_device", "set_mode_cpu", "set_mode_gpu", "set_random_seed", "TRAIN", "TEST", "Net", "Solver", "get_solver",
    "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver")}
_PYCAFFE.update({
    "NetSpec": ("superneurons.pycaffe.net_spec", "NetSpec"),
    "to_proto": ("superneurons.pycaffe.net_spec", "to_proto"),
    "params": ("superneurons.pycaffe.net_spec", "params"),
    "Classifier": ("superneurons.pycaffe.classifier", "Classifier"),
    "Detector": ("superneurons.pycaffe.classifier", "Detector"),
    "draw": ("superneurons.pycaffe.draw", None),
    # These two are also our packages: each serves pycaffe's names besides its own (see their __getattr__).
    "io": ("superneurons.io", None),
    "layers": ("superneurons.layers", None),
})


def __getattr__(name: str):
    if name not in _PYCAFFE:
        raise AttributeError(f"module 'superneurons' has no attribute {name!r}")
    import importlib

    module_name, attribute = _PYCAFFE[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
