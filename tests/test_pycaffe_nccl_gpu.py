"""caffe.NCCL the way Caffe's python/train.py uses it: one process per GPU, each told solver_count and
solver_rank, rank 0's weights broadcast, gradients averaged before every update (per layer during backward
under layer_wise_reduce). Two ranks on half batches each end with the weights one CPU process reaches on
the whole batch."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA_LAYER = '''
import numpy as np
import superneurons as caffe


class RankBatches(caffe.Layer):
    """Rows 16 / solver_count * rank onwards of one fixed regression problem: the ranks split the batch."""

    def setup(self, bottom, top):
        rng = np.random.default_rng(3)
        self.x = rng.standard_normal((16, 4)).astype(np.float32)
        self.y = (self.x @ rng.standard_normal((4, 2))).astype(np.float32)
        self.n = 16 // caffe.solver_count()
        self.lo = self.n * caffe.solver_rank()

    def reshape(self, bottom, top):
        top[0].reshape(self.n, 4)
        top[1].reshape(self.n, 2)

    def forward(self, bottom, top):
        top[0].data[...] = self.x[self.lo:self.lo + self.n]
        top[1].data[...] = self.y[self.lo:self.lo + self.n]
'''

NET = """name: 'split'
layer { name: 'data' type: 'Python' top: 'x' top: 'y' python_param { module: 'rank_batches' layer: 'RankBatches' } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'p'
        inner_product_param { num_output: 2 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'p' bottom: 'y' top: 'loss' }
"""

TRAIN = '''
import sys
from multiprocessing import get_context

import numpy as np
import superneurons as caffe


def solve(proto, gpus, uid, rank, out):
    caffe.set_mode_gpu()
    caffe.set_device(gpus[rank])
    caffe.set_solver_count(len(gpus))
    caffe.set_solver_rank(rank)
    caffe.set_multiprocess(True)
    solver = caffe.SGDSolver(proto)
    nccl = caffe.NCCL(solver, uid)
    nccl.bcast()
    solver.add_callback(nccl)
    if solver.param.layer_wise_reduce:
        solver.net.after_backward(nccl)
    solver.step(solver.param.max_iter)
    np.save(out % rank, solver.net.params["ip"][0].data)


if __name__ == "__main__":
    proto, out = sys.argv[1], sys.argv[2]
    gpus = [0, 1]
    uid = caffe.NCCL.new_uid()
    caffe.init_log()
    caffe.log("Using devices %s" % str(gpus))
    procs = [get_context("spawn").Process(target=solve, args=(proto, gpus, uid, rank, out)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
'''


@pytest.mark.parametrize("layer_wise", [True, False])
def test_train_py_pattern_on_two_gpus_matches_one_cpu_process_on_the_whole_batch(tmp_path, layer_wise):
    import superneurons as caffe
    from superneurons.parallel.devices import gpu_count

    if gpu_count() < 2 or not caffe.has_nccl():
        pytest.skip("needs 2 GPUs and NCCL's Python binding")
    (tmp_path / "rank_batches.py").write_text(DATA_LAYER)
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "solver.prototxt").write_text(textwrap.dedent(f"""\
        net: '{tmp_path / 'net.prototxt'}'
        base_lr: 0.05 momentum: 0.9 lr_policy: 'fixed' max_iter: 5 display: 1 random_seed: 11
        layer_wise_reduce: {'true' if layer_wise else 'false'}"""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               NCCL_NVLS_ENABLE="0", SUPERNEURONS_TF32="0")
    out = str(tmp_path / "rank%d.npy")
    run = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(tmp_path / "solver.prototxt"), out],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Using devices [0, 1]" in run.stderr
    rank0, rank1 = np.load(out % 0), np.load(out % 1)
    np.testing.assert_array_equal(rank0, rank1)  # one update everywhere, from rank 0's weights
    # The reference: one CPU process on all 16 rows (EuclideanLoss averages over the batch, NCCL over ranks).
    reference = subprocess.run(
        [sys.executable, "-c", "import sys, numpy as np, superneurons as caffe; caffe.set_mode_cpu(); "
         "s = caffe.SGDSolver(sys.argv[1]); s.step(5); np.save(sys.argv[2], s.net.params['ip'][0].data)",
         str(tmp_path / "solver.prototxt"), str(tmp_path / "cpu.npy")], env=env, capture_output=True, text=True,
        timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    np.testing.assert_allclose(rank0, np.load(tmp_path / "cpu.npy"), rtol=1e-4, atol=1e-6)
