"""Python layers (`type: "Python"`, layers/python_layer.py): the user's class runs forward and backward, its
blobs are parameters the solver trains and caffemodels keep, data and loss layers written in Python drive
training, errors name the layer. References are NumPy formulas on fresh random inputs."""
import textwrap

import numpy as np
import pytest

import superneurons as caffe
from gpu_harness import gpu_available
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net
from superneurons.layers import python_layer
from superneurons.memory.plan import make_plan

LAYERS = '''
import numpy as np
import superneurons as caffe


class Affine(caffe.Layer):
    """y = w * x + c, one learnable w and c per channel; param_str is the initial w."""

    def setup(self, bottom, top):
        channels = bottom[0].data.shape[1]
        self.blobs.add_blob(channels)
        self.blobs.add_blob(channels)
        self.blobs[0].data[...] = float(self.param_str)
        self.blobs[1].data[...] = np.arange(channels)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data[None, :] * bottom[0].data + self.blobs[1].data[None, :]

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[...] += (top[0].diff * bottom[0].data).sum(axis=0)
        self.blobs[1].diff[...] += top[0].diff.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = self.blobs[0].data[None, :] * top[0].diff


class Squares(caffe.Layer):
    """Half the mean squared difference of two bottoms (a loss; the top's diff is its weight)."""

    def reshape(self, bottom, top):
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.d = bottom[0].data - bottom[1].data
        top[0].data[...] = (self.d ** 2).sum() / bottom[0].num / 2.0

    def backward(self, top, propagate_down, bottom):
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                bottom[i].diff[...] = sign * top[0].diff[0] * self.d / bottom[i].num


class Batches(caffe.Layer):
    """A data layer: batch k of a fixed random regression problem, k counted in the layer."""

    def setup(self, bottom, top):
        rng = np.random.default_rng(int(self.param_str))
        self.x = rng.standard_normal((32, 3)).astype(np.float32)
        self.y = (self.x * np.array([1.5, -2.0, 0.5]) + 0.25).astype(np.float32)
        self.k = 0

    def reshape(self, bottom, top):
        top[0].reshape(8, 3)
        top[1].reshape(8, 3)

    def forward(self, bottom, top):
        lo = (self.k % 4) * 8
        top[0].data[...] = self.x[lo:lo + 8]
        top[1].data[...] = self.y[lo:lo + 8]
        self.k += 1


class Phase(caffe.Layer):
    def reshape(self, bottom, top):
        top[0].reshape()

    def forward(self, bottom, top):
        top[0].data[()] = self.phase


class Fails(caffe.Layer):
    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        raise ZeroDivisionError("the user's own bug")


class Grows(caffe.Layer):
    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].num + getattr(self, "extra", 0), *bottom[0].data.shape[1:])
        self.extra = 1

    def forward(self, bottom, top):
        pass
'''

AFFINE_NET = """name: 'py' force_backward: true
input: 'x' input_shape { dim: 5 dim: 3 }
layer { name: 'aff' type: 'Python' bottom: 'x' top: 'y'
        python_param { module: 'pylayers_for_tests' layer: 'Affine' param_str: '0.5' } }
"""

TRAIN_NET = """name: 'fit'
layer { name: 'data' type: 'Python' top: 'x' top: 'target'
        python_param { module: 'pylayers_for_tests' layer: 'Batches' param_str: '7' } }
layer { name: 'aff' type: 'Python' bottom: 'x' top: 'y'
        python_param { module: 'pylayers_for_tests' layer: 'Affine' param_str: '0' } }
layer { name: 'loss' type: 'Python' bottom: 'y' bottom: 'target' top: 'loss' loss_weight: 2
        python_param { module: 'pylayers_for_tests' layer: 'Squares' } }
"""


@pytest.fixture(autouse=True)
def layer_module(tmp_path, monkeypatch):
    (tmp_path / "pylayers_for_tests.py").write_text(LAYERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    caffe.set_mode_cpu()
    yield


def _net(tmp_path, text, phase=caffe.TRAIN, **kwargs):
    path = tmp_path / "net.prototxt"
    path.write_text(textwrap.dedent(text))
    return caffe.Net(str(path), phase, **kwargs)


@pytest.fixture(params=[False, True], ids=["views", "host-copies"])
def copies(request, monkeypatch):
    """Both ways a Python layer sees the net's arrays: the CPU's own memory, and the GPU's host copies."""
    monkeypatch.setattr(python_layer, "COPY_HOST_ARRAYS", request.param)
    return request.param


def test_forward_backward_and_blobs_follow_numpy(tmp_path, copies):
    net = _net(tmp_path, AFFINE_NET)
    rng = np.random.default_rng()
    x, dy = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    w, c = net.params["aff"][0].data, net.params["aff"][1].data
    np.testing.assert_array_equal(w, [0.5] * 3)
    assert net.layer_dict["aff"].param_str == "0.5"  # the user's object's attributes, as pycaffe hands it out
    np.testing.assert_array_equal(c, [0, 1, 2])
    w[...] = rng.standard_normal(3)  # edits through pycaffe reach the layer's blobs
    y = net.forward(x=x)["y"]
    np.testing.assert_allclose(y, w * x + c, rtol=1e-6)
    grads = net.backward(y=dy)
    np.testing.assert_allclose(grads["x"], w * dy, rtol=1e-6)
    np.testing.assert_allclose(net.params["aff"][0].diff, (dy * x).sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(net.params["aff"][1].diff, dy.sum(axis=0), rtol=1e-5)


def test_blobs_are_saved_loaded_and_shared(tmp_path):
    net = _net(tmp_path, AFFINE_NET)
    net.params["aff"][0].data[...] = [1.0, 2.0, 3.0]
    net.save(str(tmp_path / "w.caffemodel"))
    other = _net(tmp_path, AFFINE_NET, weights=str(tmp_path / "w.caffemodel"))
    np.testing.assert_array_equal(other.params["aff"][0].data, [1, 2, 3])
    third = _net(tmp_path, AFFINE_NET)
    third.share_with(net)
    net.params["aff"][0].data[...] = [4.0, 5.0, 6.0]
    x = np.ones((5, 3), np.float32)
    np.testing.assert_allclose(third.forward(x=x)["y"], [[4, 6, 8]] * 5)


def test_python_data_and_loss_layers_train_with_the_solver(tmp_path, copies):
    (tmp_path / "train.prototxt").write_text(TRAIN_NET)
    (tmp_path / "solver.prototxt").write_text(f"net: '{tmp_path / 'train.prototxt'}'\nbase_lr: 0.1\n"
                                              "lr_policy: 'fixed'\nmax_iter: 1\ndisplay: 0\n")
    solver = caffe.get_solver(str(tmp_path / "solver.prototxt"))
    net = solver.net
    assert net.blob_loss_weights["loss"] == 2
    w0, c0 = net.params["aff"][0].data.copy(), net.params["aff"][1].data.copy()
    solver.step(1)
    # The reference: batch 0 of the data layer's problem, the gradient of 2 * mean-squared-error / 2.
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, 3)).astype(np.float32)[:8]
    target = x * np.array([1.5, -2.0, 0.5]) + 0.25
    dy = 2 * (w0 * x + c0 - target) / 8
    np.testing.assert_allclose(net.params["aff"][0].data, w0 - 0.1 * (dy * x).sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(net.params["aff"][1].data, c0 - 0.1 * dy.sum(axis=0), rtol=1e-5)
    solver.step(60)
    np.testing.assert_allclose(net.params["aff"][0].data, [1.5, -2.0, 0.5], atol=0.05)
    assert float(net.blobs["loss"].data[0]) < 1e-3


@pytest.mark.parametrize("memory", ["liveness", "offload", "recompute"])
def test_training_under_every_memory_mode_matches_baseline(tmp_path, memory):
    (tmp_path / "train.prototxt").write_text(TRAIN_NET)
    (tmp_path / "solver.prototxt").write_text(f"net: '{tmp_path / 'train.prototxt'}'\nbase_lr: 0.1\n"
                                              "lr_policy: 'fixed'\nmax_iter: 1\ndisplay: 0\n")
    weights = []
    for mode in ("baseline", memory):
        solver = caffe.get_solver(str(tmp_path / "solver.prototxt"), memory=mode)
        solver.step(3)
        weights.append([p.data.copy() for p in solver.net.params["aff"]])
    for base, other in zip(*weights):
        np.testing.assert_allclose(other, base, rtol=1e-6)


def test_phase_param_str_and_data_layer_planning(tmp_path):
    text = "layer { name: 'p' type: 'Python' top: 'phase' python_param { module: 'pylayers_for_tests' " \
           "layer: 'Phase' } }"
    for phase in (caffe.TRAIN, caffe.TEST):
        assert _net(tmp_path, text, phase).forward()["phase"] == phase
    (tmp_path / "train.prototxt").write_text(TRAIN_NET)
    graph = build_graph(read_net(str(tmp_path / "train.prototxt")), caffe.TRAIN)
    data = graph.node("data")
    assert data.layer.is_data and not data.need_backward  # a Python layer without bottoms produces data
    plan = make_plan(graph, train=True, plan_backward=False)
    assert plan is not None


def test_errors_keep_the_users_traceback_and_name_the_layer(tmp_path):
    text = """input: 'x' input_shape { dim: 2 dim: 3 }
    layer { name: 'bad' type: 'Python' bottom: 'x' top: 'y'
            python_param { module: 'pylayers_for_tests' layer: 'Fails' } }
    """
    net = _net(tmp_path, text)
    with pytest.raises(ZeroDivisionError, match="the user's own bug") as info:
        net.forward()
    assert "in Python layer 'bad' (pylayers_for_tests.Fails), forward()" in info.value.__notes__
    with pytest.raises(UserError, match=r"layer 'bad' \(Python\): python_param.module 'no_such_module': no such "
                                        r"module on sys.path"):
        _net(tmp_path, text.replace("pylayers_for_tests", "no_such_module"))
    with pytest.raises(UserError, match=r"python_param.layer 'Nope'"):
        _net(tmp_path, text.replace("Fails", "Nope"))
    with pytest.raises(UserError, match=r"layer 'bad' \(Python\): top 0: reshape to \(3, 3\) while the net runs "
                                        r"with \(2, 3\)"):
        _net(tmp_path, text.replace("Fails", "Grows")).forward()


def test_netspec_writes_python_param():
    n = caffe.NetSpec()
    n.x = caffe.layers.Input(shape=dict(dim=[2, 3]))
    n.y = caffe.layers.Python(n.x, module="pylayers_for_tests", layer="Affine", param_str="0.5")
    layer = n.to_proto().layer[1]
    assert (layer.type, layer.python_param.module, layer.python_param.layer, layer.python_param.param_str) == (
        "Python", "pylayers_for_tests", "Affine", "0.5")


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")
def test_gpu_python_layer_matches_the_cpu(tmp_path):
    rng = np.random.default_rng()
    x, dy = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    results = []
    for set_mode in (caffe.set_mode_cpu, caffe.set_mode_gpu):
        set_mode()
        net = _net(tmp_path, AFFINE_NET)
        net.params["aff"][0].data[...] = [0.5, -1.0, 2.0]
        y = net.forward(x=x)["y"].copy()
        dx = net.backward(y=dy)["x"].copy()
        results.append((y, dx, net.params["aff"][0].diff.copy()))
    caffe.set_mode_cpu()
    for cpu, gpu in zip(*results):
        np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-6)
