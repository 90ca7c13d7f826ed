"""The Accuracy layer (layers/accuracy.py) against NumPy's top-k, with Caffe's tie rule."""
import numpy as np
import pytest
from harness import forward, make_layer

from superneurons.errors import UserError


def _topk_ref(scores, labels, k, axis, ignore):
    """Direct computation: is the label among the k largest scores along `axis` (no ties in random data)."""
    s = np.moveaxis(scores, axis, -1)
    c = s.shape[-1]
    s = s.reshape(-1, c)
    lab = labels.reshape(-1)
    top = np.argsort(-s, axis=1)[:, :k]
    counted = lab != ignore if ignore is not None else np.ones(lab.shape, bool)
    hit = np.array([int(l) in t for l, t in zip(lab, top)]) & counted
    per_class = [hit[counted & (lab == j)].mean() if (counted & (lab == j)).any() else 0.0 for j in range(c)]
    return hit.sum() / max(counted.sum(), 1), np.array(per_class)


@pytest.mark.parametrize("shape,axis,k,ignore", [
    ((40, 7), 1, 1, None),
    ((40, 7), 1, 3, 2),
    ((6, 5, 3, 4), 1, 2, None),
    ((6, 3, 4, 5), -1, 1, 0),
])
def test_accuracy_against_numpy_topk(shape, axis, k, ignore):
    rng = np.random.default_rng(23 + k)
    scores = rng.standard_normal(shape)
    c = shape[axis]
    label_shape = tuple(d for i, d in enumerate(shape) if i != axis % len(shape))
    labels = rng.integers(0, c, label_shape).astype(np.float64)
    axis_field = f"axis: {axis} " if axis != 1 else ""
    ignore_field = f"ignore_label: {ignore} " if ignore is not None else ""
    proto = (f"type: 'Accuracy' accuracy_param {{ top_k: {k} {axis_field}{ignore_field}}} "
             "bottom: 's' bottom: 'l' top: 'acc' top: 'per_class'")
    layer, shapes = make_layer(proto, [scores.shape, labels.shape])
    assert shapes == [(), (c,)] and not layer.has_backward
    acc, per_class = forward(layer, [scores, labels], shapes)
    ref_acc, ref_per_class = _topk_ref(scores, labels, k, axis, ignore)
    assert 0.0 < ref_acc < 1.0  # a case that can tell right from wrong
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-12)
    np.testing.assert_allclose(per_class, ref_per_class, rtol=1e-12)


def test_accuracy_ties_count_against_the_true_class_as_in_caffe():
    layer, shapes = make_layer("type: 'Accuracy' accuracy_param { top_k: 2 } top: 'acc' top: 'per_class'",
                               [(4, 4), (4,)])
    scores = np.array([[1.0, 1.0, 1.0, 1.0],    # all tied: 3 others >= true, not in top 2
                       [3.0, 2.0, 2.0, 0.0],    # true 2 ties with 1, one higher: 2 others >= -> wrong
                       [3.0, 2.0, 1.0, 0.0],    # true 1: one higher -> right
                       [2.0, 2.0, 0.0, 0.0]])   # true 1 ties with 0 only -> right
    acc, per_class = forward(layer, [scores, np.array([0.0, 2.0, 1.0, 1.0])], shapes)
    np.testing.assert_allclose(acc, 0.5)
    np.testing.assert_allclose(per_class, [0.0, 1.0, 0.0, 0.0])  # class 3 never appears: 0, as in Caffe


def test_accuracy_rejects_top_k_beyond_classes_and_all_ignored_gives_zero():
    with pytest.raises(UserError, match=r"top_k is 5.*4 classes"):
        make_layer("type: 'Accuracy' accuracy_param { top_k: 5 }", [(3, 4), (3,)])
    layer, shapes = make_layer("type: 'Accuracy' accuracy_param { ignore_label: 1 }", [(3, 4), (3,)])
    (acc,) = forward(layer, [np.random.default_rng(0).standard_normal((3, 4)), np.ones(3)], shapes)
    assert acc == 0.0
