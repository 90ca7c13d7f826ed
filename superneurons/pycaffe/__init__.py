"""pycaffe's Python interface over SuperNeurons: `import superneurons as caffe` and classic pycaffe code runs.

What each name does and where it departs from pycaffe: docs/PYTHON.md. The modules: `mode` (CPU/GPU,
device, seed, the ranks of a data-parallel job), `net` (Net, Blob), `solver` (get_solver and the solver
classes), `coord_map` (the coordinate mapping between a NetSpec's tops, `crop`), `draw` (net pictures),
`classifier` (Classifier, Detector), `glog` (log lines, Timer), `nccl` (NCCL between the processes of a
job). `caffe.io` (Transformer and the array/proto conversions) and NetSpec (`caffe.layers`, `caffe.params`)
read and write Caffe's files, so they live below, in `superneurons/io/caffe_io.py` and
`superneurons/io/net_spec.py`. `superneurons/__init__.py` re-exports them lazily, so the command line never
imports this package.
"""
from superneurons.layers.base import known_types as layer_type_list
from superneurons.pycaffe.glog import Timer, init_log, log
from superneurons.pycaffe.mode import (set_device, set_mode_cpu, set_mode_gpu, set_multiprocess, set_random_seed,
                                       set_solver_count, set_solver_rank, solver_count, solver_rank)
from superneurons.pycaffe.nccl import NCCL, has_nccl
from superneurons.pycaffe.net import TEST, TRAIN, Net
from superneurons.pycaffe.solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver,
                                         SGDSolver, Solver, get_solver)

__all__ = ["set_device", "set_mode_cpu", "set_mode_gpu", "set_random_seed", "TRAIN", "TEST", "Net", "Solver",
           "get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
           "AdamSolver", "layer_type_list", "Timer", "init_log", "log", "solver_count", "set_solver_count",
           "solver_rank", "set_solver_rank", "set_multiprocess", "NCCL", "has_nccl"]
