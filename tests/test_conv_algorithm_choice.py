"""How convolution algorithms are chosen (backend/cuda/cudnn.py, cudnn_graph.py), the parts that need no GPU:
which ranking the settings ask for, which plans measuring times (`first_precompiled`), and `Candidates.pick`, which every call uses to take the first ranked
choice whose workspace fits what the pool has free."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from superneurons.backend.cuda import cudnn
from superneurons.backend.cuda.cudnn_graph import Candidates, NoFit, first_precompiled


@pytest.mark.parametrize("find,deterministic,measures", [
    (None, None, True),  # the default: measured, as PyTorch's cudnn.benchmark
    ("0", None, False),
    ("1", "1", False),  # repeatable runs must also choose the same engines: the heuristics rank
    (None, "1", False),
    ("1", "0", True),
])
def test_the_settings_pick_measured_or_heuristic_ranking(monkeypatch, find, deterministic, measures):
    for name, value in (("SUPERNEURONS_CUDNN_FIND", find), ("SUPERNEURONS_CUDNN_DETERMINISTIC", deterministic)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert cudnn.measures_algorithms() is measures


@dataclass
class Choice:
    name: str
    workspace: int


def test_candidates_take_the_first_that_fits_and_build_lazily():
    built = []

    def more():
        for choice in (Choice("b", 10), Choice("c", 0)):
            built.append(choice.name)
            yield choice

    candidates = Candidates(more(), [Choice("a", 100)])
    assert candidates.pick(1000).name == "a" and built == []  # the first fits: nothing more is built
    assert candidates.pick(50).name == "b" and built == ["b"]
    assert candidates.pick(5).name == "c" and built == ["b", "c"]
    assert candidates.pick(100).name == "a"  # back up: the earlier choice again
    assert [c.name for c in candidates.items] == ["a", "b", "c"]


def test_candidates_say_what_the_smallest_needs_when_none_fits():
    candidates = Candidates(iter(()), [Choice("a", 100), Choice("b", 40)])
    with pytest.raises(NoFit, match="no convolution algorithm fits in 39 bytes of workspace \\(the smallest needs 40\\)"):
        candidates.pick(39)
    with pytest.raises(NoFit, match="none is usable"):
        Candidates(iter(())).pick(1 << 30)


@dataclass
class Plan:
    name: str
    precompiled: bool


@pytest.mark.parametrize("flags,limit,timed,compiled,drawn", [
    ("pppp", 2, "ab", "", "ab"),  # stops at the limit without building the rest
    ("ppcp", 8, "ab", "c", "abc"),  # stops at the first plan compiled at run time, which ranks after them
    ("pp", 8, "ab", "", "ab"),  # fewer than the limit: all of them
    ("cp", 8, "", "a", "a"),
])
def test_measuring_times_the_first_precompiled_plans_and_builds_no_more(flags, limit, timed, compiled, drawn):
    names = "abcdefgh"
    built = []

    def plans():
        for name, flag in zip(names, flags):
            built.append(name)
            yield Plan(name, flag == "p")

    ranked = plans()
    got, runtime = first_precompiled(ranked, limit)
    assert "".join(p.name for p in got) == timed and "".join(p.name for p in runtime) == compiled
    assert "".join(built) == drawn
    # what the candidates may still build later, in ranking order: the plans not drawn yet
    assert "".join(p.name for p in ranked) == names[len(drawn):len(flags)]
