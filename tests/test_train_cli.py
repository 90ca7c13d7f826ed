"""`superneurons train` and `superneurons test` end to end: Caffe's log lines, files written, one-line errors."""
from __future__ import annotations

import json

import pytest
from logs import GLOG, messages
from test_solver import TINY_NET

from superneurons.cli import main

SOLVER = """net: "nets/tiny.prototxt"
test_iter: 2
test_interval: 4
base_lr: 0.05
momentum: 0.9
lr_policy: "step"
gamma: 0.5
stepsize: 3
display: 2
max_iter: 6
snapshot: 4
snapshot_prefix: "out/tiny"
random_seed: 1
solver_mode: CPU
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A solver in conf/ naming its net relative to its own folder, run from tmp_path (the folder fallback)."""
    (tmp_path / "conf/nets").mkdir(parents=True)
    (tmp_path / "conf/nets/tiny.prototxt").write_text(TINY_NET)
    (tmp_path / "conf/solver.prototxt").write_text(SOLVER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _error(capsys) -> str:
    """The error line on stderr (log lines written before the error are glog lines and left aside)."""
    err = [line for line in capsys.readouterr().err.splitlines() if not GLOG.fullmatch(line)]
    assert len(err) == 1, err
    return err[0]


def test_train_prints_caffe_log_lines_and_writes_snapshots(workdir, capsys):
    rc = main(["train", "--solver", "conf/solver.prototxt", "--log", "train.log", "--log-json", "train.jsonl"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out == ""  # Caffe's log goes to stderr, as glog's
    lines = messages(captured.err)
    assert len(lines) == len(captured.err.splitlines())  # every line is a glog line
    for expected in ("Solving tiny", "Learning Rate Policy: step", "Iteration 0, Testing net (#0)",
                     "Iteration 2, lr = 0.05", "Iteration 4, lr = 0.025",
                     "Snapshotting to binary proto file out/tiny_iter_4.caffemodel",
                     "Snapshotting solver state to binary proto file out/tiny_iter_4.solverstate",
                     "Snapshotting to binary proto file out/tiny_iter_6.caffemodel", "Optimization Done."):
        assert expected in lines, expected
    assert any(l.startswith("Iteration 2 (") and "iter/s" in l and "s/2 iters), loss = " in l for l in lines)
    assert any(l.startswith("    Train net output #0: loss = ") and l.endswith(" loss)") for l in lines)
    assert any(l.startswith("    Test net output #0: accuracy = ") for l in lines)
    assert lines.index("Iteration 4, Testing net (#0)") < lines.index("Iteration 4, lr = 0.025")
    assert (workdir / "train.log").read_text().splitlines() == captured.err.splitlines()
    records = [json.loads(l) for l in (workdir / "train.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records if r["event"] == "train"] == [0, 2, 4, 6]
    assert [r["iter"] for r in records if r["event"] == "test"] == [0, 4]
    assert 0 <= records[0]["outputs"]["accuracy"] <= 1
    for name in ("tiny_iter_4.caffemodel", "tiny_iter_4.solverstate", "tiny_iter_6.caffemodel"):
        assert (workdir / "out" / name).exists()

    assert main(["test", "--model", "conf/nets/tiny.prototxt", "--weights", "out/tiny_iter_6.caffemodel",
                 "--iterations", "3"]) == 0
    out = messages(capsys.readouterr().err)
    assert "Running for 3 iterations." in out
    assert sum(l.startswith("Batch ") for l in out) == 6
    assert any(l.startswith("accuracy = ") for l in out)
    assert any(l.startswith("loss = ") and l.endswith(" loss)") for l in out)


def test_resume_through_the_cli_matches(workdir, capsys):
    assert main(["train", "--solver", "conf/solver.prototxt"]) == 0
    first = (workdir / "out/tiny_iter_6.caffemodel").read_bytes()
    (workdir / "out/tiny_iter_6.caffemodel").unlink()
    assert main(["train", "--solver", "conf/solver.prototxt", "--snapshot", "out/tiny_iter_4.solverstate"]) == 0
    out = messages(capsys.readouterr().err)
    assert "Restoring previous solver status from out/tiny_iter_4.solverstate" in out
    assert (workdir / "out/tiny_iter_6.caffemodel").read_bytes() == first


def test_missing_solver_file(workdir, capsys):
    assert main(["train", "--solver", "nope.prototxt"]) == 1
    assert "nope.prototxt: no such file" in _error(capsys)


def test_malformed_solver_names_line_and_column(workdir, capsys):
    (workdir / "bad.prototxt").write_text('net: "conf/nets/tiny.prototxt"\nbase_lr: fast\n')
    assert main(["train", "--solver", "bad.prototxt"]) == 1
    assert _error(capsys).startswith("superneurons train: error: bad.prototxt:2:")


def test_missing_net_file(workdir, capsys):
    (workdir / "conf/solver.prototxt").write_text(SOLVER.replace("nets/tiny", "nets/absent"))
    assert main(["train", "--solver", "conf/solver.prototxt"]) == 1
    err = _error(capsys)
    assert "conf/solver.prototxt" in err and "'nets/absent.prototxt' does not exist" in err


def test_snapshot_and_weights_together_is_an_error(workdir, capsys):
    assert main(["train", "--solver", "conf/solver.prototxt", "--snapshot", "a", "--weights", "b"]) == 1
    assert "not both" in _error(capsys)


def test_weights_flag_fine_tunes(workdir, capsys):
    assert main(["train", "--solver", "conf/solver.prototxt"]) == 0
    assert main(["train", "--solver", "conf/solver.prototxt", "--weights", "out/tiny_iter_6.caffemodel"]) == 0
    out = "\n".join(messages(capsys.readouterr().err))
    assert "Copied weights of 2 layer(s) from out/tiny_iter_6.caffemodel" in out
    assert main(["train", "--solver", "conf/solver.prototxt", "--weights", "missing.caffemodel"]) == 1
    assert "missing.caffemodel" in _error(capsys)


def test_help_has_examples(capsys):
    for command in ("train", "test"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "examples:" in capsys.readouterr().out


def test_memory_flags_and_memory_param_reach_the_nets(workdir, capsys, monkeypatch):
    # Without --memory the solver's memory_param.mode applies (its default: auto); --gpu-memory sizes the
    # training net's pool (test nets keep pools sized to their own need).
    from superneurons.solver import Solver

    built = []
    real_init = Solver.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        built.append(self)

    monkeypatch.setattr(Solver, "__init__", spy)
    text = SOLVER.replace("max_iter: 6", "max_iter: 2").replace("snapshot: 4", "snapshot: 0")
    (workdir / "conf/solver.prototxt").write_text(text + "memory_param { mode: LIVENESS }\n")
    assert main(["train", "--solver", "conf/solver.prototxt", "--no-progress", "--gpu-memory", "4M"]) == 0
    net = built[-1].net
    assert net.memory.name == "liveness" and net.pool.capacity == 4 << 20
    assert built[-1].test_nets[0].pool.capacity < 4 << 20
    (workdir / "conf/solver.prototxt").write_text(text)
    assert main(["train", "--solver", "conf/solver.prototxt", "--no-progress", "--memory", "offload"]) == 0
    assert built[-1].net.memory.name == "offload"
    assert main(["train", "--solver", "conf/solver.prototxt", "--no-progress"]) == 0
    assert built[-1].net.memory.name == "baseline"  # auto: the default CPU pool holds everything
    capsys.readouterr()
    assert main(["train", "--solver", "conf/solver.prototxt", "--no-progress", "--memory", "liveness",
                 "--gpu-memory", "4K"]) == 1
    err = _error(capsys)
    assert "cannot train this net" in err or "cannot hold" in err, err
    assert main(["test", "--model", "conf/nets/tiny.prototxt", "--iterations", "1", "--gpu-memory", "4M",
                 "--memory", "recompute"]) == 0


def test_solver_takes_the_pool_size():
    from test_solver import solver_param

    from superneurons.solver import Solver

    s = Solver(solver_param("base_lr: 0.1 max_iter: 1"), "s.prototxt", pool_bytes=3 << 20, memory="liveness")
    assert s.net.pool.capacity == 3 << 20
