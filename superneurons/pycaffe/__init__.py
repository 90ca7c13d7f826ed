"""pycaffe's Python interface over SuperNeurons: `import superneurons as caffe` and classic pycaffe code runs.

What each name does and where it departs from pycaffe: docs/PYTHON.md. The modules: `mode` (CPU/GPU,
device, seed), `net` (Net, Blob), `solver` (get_solver and the solver classes), `io` (Transformer and
the array/proto conversions), `net_spec` (NetSpec, layers, params), `draw` (net pictures), `classifier`.
`superneurons/__init__.py` re-exports them lazily, so the command line never imports this package.
"""
from superneurons.pycaffe.mode import set_device, set_mode_cpu, set_mode_gpu, set_random_seed
from superneurons.pycaffe.net import TEST, TRAIN, Net
from superneurons.pycaffe.solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver,
                                         SGDSolver, Solver, get_solver)

__all__ = ["set_device", "set_mode_cpu", "set_mode_gpu", "set_random_seed", "TRAIN", "TEST", "Net", "Solver",
           "get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
           "AdamSolver"]
