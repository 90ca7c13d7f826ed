"""SuperNeurons: a Caffe-compatible training framework that trains networks larger than the GPU's memory.

`import superneurons as caffe` gives pycaffe's interface (Net, get_solver, io, NetSpec, ...; docs/PYTHON.md).
Those names load on first use, so importing the package (and the command line) stays cheap.
"""

__version__ = "0.1.0"

# pycaffe name -> (module, attribute or None for the module itself)
_PYCAFFE = {name: ("superneurons.pycaffe", name) for name in (
    "set_device", "set_mode_cpu", "set_mode_gpu", "set_random_seed", "TRAIN", "TEST", "Net", "Solver", "get_solver",
    "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver",
    "layer_type_list", "Timer", "init_log", "log", "solver_count", "set_solver_count", "solver_rank",
    "set_solver_rank", "set_multiprocess", "has_nccl", "NCCL")}
_PYCAFFE.update({
    "Layer": ("superneurons.layers.python_layer", "UserLayer"),
    "NetSpec": ("superneurons.io.net_spec", "NetSpec"),
    "to_proto": ("superneurons.io.net_spec", "to_proto"),
    "params": ("superneurons.io.net_spec", "params"),
    "Classifier": ("superneurons.pycaffe.classifier", "Classifier"),
    "Detector": ("superneurons.pycaffe.classifier", "Detector"),
    "proto": ("superneurons.proto", None),
    # These two are also our packages: each serves pycaffe's names besides its own (see their __getattr__).
    "io": ("superneurons.io", None),
    "layers": ("superneurons.layers", None),
})
# pycaffe's submodules, importable as `superneurons.draw` (`import caffe.draw`) and attributes alike: each is
# one of ours under another name.
_SUBMODULES = {
    "draw": "superneurons.pycaffe.draw",
    "net_spec": "superneurons.io.net_spec",
    "classifier": "superneurons.pycaffe.classifier",
    "detector": "superneurons.pycaffe.classifier",
    "coord_map": "superneurons.pycaffe.coord_map",
}
_PYCAFFE.update({name: (module, None) for name, module in _SUBMODULES.items()})


class _SubmoduleAlias:
    """Import finder: `import superneurons.draw` gives the module `superneurons.pycaffe.draw` itself."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _SUBMODULES:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _SubmoduleAlias)

    @staticmethod
    def create_module(spec):
        import importlib

        return importlib.import_module(_SUBMODULES[spec.name.rpartition(".")[2]])

    @staticmethod
    def exec_module(module) -> None:
        pass  # already imported under its own name


def _install_alias_finder() -> None:
    import sys

    if not any(f is _SubmoduleAlias for f in sys.meta_path):
        sys.meta_path.append(_SubmoduleAlias)


_install_alias_finder()


def __getattr__(name: str):
    if name not in _PYCAFFE:
        raise AttributeError(f"module 'superneurons' has no attribute {name!r}")
    import importlib

    module_name, attribute = _PYCAFFE[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
