"""summary, time and plot commands, and the one-line error contract of the CLI."""
import json
import warnings

import pytest

from superneurons.cli import main

TINY = """name: "tiny"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 8 dim: 10 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h" inner_product_param { num_output: 6 } }
layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }
layer { name: "ip2" type: "InnerProduct" bottom: "h" top: "y" inner_product_param { num_output: 3 } loss_weight: 1 }
layer { name: "ip3" type: "InnerProduct" bottom: "h" top: "z" inner_product_param { num_output: 4 } }
"""


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.prototxt"
    p.write_text(TINY)
    return str(p)


def test_summary_shapes_and_split(tiny, capsys):
    assert main(["summary", "--model", tiny, "--batch", "5"]) == 0
    out = capsys.readouterr().out
    assert "h_relu_0_split" in out  # h feeds two layers: a Split is inserted
    rows = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(("-", "Net"))}
    assert "5 3" in rows["ip2"] and "5 4" in rows["ip3"]
    assert "Parameters: 115" in out  # (6*10+6) + (3*6+3) + (4*6+4)

def test_time_reports_every_layer_and_agrees_with_iteration(tiny, capsys):
    assert main(["time", "--model", tiny, "--iterations", "3", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    names = [layer["name"] for layer in rec["layers"]]
    assert names[:3] == ["in", "ip1", "relu"] and "ip3" in names
    s = rec["summary"]
    assert s["layer_sum_ms"] <= s["forward_backward_ms"] * 1.001
    assert rec["peak_bytes"] > 0


def test_plot_writes_png(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("Iteration 0, lr = 0.01\nIteration 0 (0 iter/s), loss = 2.3\n"
                   "Iteration 0, Testing net (#0)\n    Test net output #0: accuracy = 0.1\n"
                   "Iteration 100 (5 iter/s), loss = 0.5\n")
    out = tmp_path / "c.png"
    assert main(["plot", str(log), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text, expect", [
    ('layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 2 } }\n', "bad.prototxt:1:73: layer 'a': Expected"),
    ('layer { name: "a" type: "Nope" top: "x" }\n', "unknown layer type 'Nope'"),
    ('layer { name: "a" type: "ReLU" bottom: "missing" top: "x" }\n', "unknown bottom blob 'missing'"),
    ('layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
     'layer { name: "b" type: "InnerProduct" bottom: "x" top: "y" }\n', "num_output"),
])
def test_bad_prototxt_is_one_line_and_exit_1(tmp_path, capsys, text, expect):
    p = tmp_path / "bad.prototxt"
    p.write_text(text)
    assert main(["summary", "--model", str(p)]) == 1
    err = capsys.readouterr().err.strip()
    assert expect in err and "\n" not in err and "Traceback" not in err


def test_missing_file(capsys):
    assert main(["summary", "--model", "/nonexistent/net.prototxt"]) == 1
    assert "/nonexistent/net.prototxt: no such file" in capsys.readouterr().err


def test_time_shows_the_convolution_algorithm(tmp_path, capsys):
    p = tmp_path / "conv.prototxt"
    p.write_text('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }\n'
                 'layer { name: "c" type: "Convolution" bottom: "x" top: "y" loss_weight: 1 '
                 'convolution_param { num_output: 4 kernel_size: 3 } }\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the inputs start at zero, as Caffe's blobs do: no overflow from garbage
        assert main(["time", "--model", str(p), "--iterations", "2", "--json"]) == 0
    layers = {rec["name"]: rec for rec in json.loads(capsys.readouterr().out)["layers"]}
    assert layers["c"]["algo"] == "im2col+gemm" and layers["in"]["algo"] == ""
