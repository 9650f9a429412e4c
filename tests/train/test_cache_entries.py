"""remat's on-disk caches never lie and never kill (issue 47, item 10): in each cache (captures,
kernel workspaces, generated kernel sources, Numba's compiled kernels, the planner's HiGHS solves) a truncated, empty,
random or other-version file where an entry lives is ignored with a warning naming its path and
rebuilt, and the compile trains as eager PyTorch does; an entry is written atomically."""
from __future__ import annotations

import copy
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import remat
from remat import cache as rcache
from remat import zoo
from remat.backends import numba_kernels as nk
from remat.frontend import capture_cache
from remat.runtime import allocator

DAMAGE = ("truncated", "empty", "random", "version")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """A cache directory of this test's own, the capture cache on, nothing remembered in the process."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REMAT_CAPTURE_CACHE", "1")
    _forget()
    yield
    _forget()


def _forget() -> None:
    """What this process keeps of the disk caches: a later compile reads them again, as a new process would."""
    allocator.clear_cache()
    nk._kernels.clear()
    nk._plans.clear()


def _compile_and_train(name: str = "mlp", steps: int = 2):
    """Compile a tiny zoo model (budgeted: workspaces are measured) and train it ``steps`` SGD steps;
    its parameters must be eager PyTorch's. Returns the step and the warnings the compile and steps
    gave. The MLP runs no generated kernel, the ResNet does."""
    model, inputs, loss_fn = zoo.make(name, "tiny")
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = remat.compile(model, inputs, loss_fn, optimizer=opt, budget=1.0)
        for _ in range(steps):
            loss = step(*inputs)
            ref_opt.zero_grad()
            want = loss_fn(ref(*inputs[:-1]), inputs[-1])
            want.backward()
            ref_opt.step()
            assert abs(float(loss) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{pname} differs from eager")
    return step, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "random":
        path.write_bytes(os.urandom(max(len(data), 64)))
    elif how == "version":  # a whole entry, checksum and all, of another format version
        head = data.split(b"\n", 1)[0].decode().split(" ")
        tag, version = head[1], int(head[2][1:])
        payload, why = rcache.check_entry(data, tag, version)
        assert payload is not None, why
        rcache.write_entry(path, tag, version + 1, payload)
    else:
        raise ValueError(how)


def _named(warned: list[str], path: Path) -> bool:
    return any(str(path) in w for w in warned)


def _valid(path: Path) -> bool:
    data = path.read_bytes()
    head = data.split(b"\n", 1)[0].decode(errors="replace").split(" ")
    return len(head) == 5 and rcache.check_entry(data, head[1], int(head[2][1:]))[0] is not None


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_capture_is_captured_again(how):
    first, _ = _compile_and_train()
    assert not first.report().capture_cached
    (entry,) = capture_cache.cache_dir().glob("*.json")
    _damage(entry, how)
    _forget()
    second, warned = _compile_and_train()
    assert not second.report().capture_cached
    assert _named(warned, entry), warned
    assert _valid(entry)  # rebuilt
    _forget()
    third, warned = _compile_and_train()
    assert third.report().capture_cached and not warned


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_workspace_cache_is_measured_again(how):
    _compile_and_train()
    path = allocator.cache_file()
    assert path.is_file()
    _damage(path, how)
    _forget()
    _, warned = _compile_and_train()
    assert _named(warned, path), warned
    assert _valid(path) and allocator._read_disk()  # rebuilt, with the measurements


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_kernel_source_is_generated_again(how):
    _compile_and_train("resnet")
    sources = sorted((rcache.cache_root() / "kernels").glob("k_*.py"))
    assert sources, "the tiny ResNet runs no generated kernel"
    for s in sources:
        _damage(s, how)
    _forget()
    _, warned = _compile_and_train("resnet")
    for s in sources:
        assert _named(warned, s), warned
        assert _valid(s)


@pytest.mark.parametrize("source", ["def kernel(:\n", "SIGNATURE = 'void()'\n"], ids=["syntax error", "no kernel"])
def test_a_kernel_entry_of_another_writer_is_generated_again(source):
    """An entry whole and checksummed but holding other source than its key's kernel (another writer's,
    a bug's) is written again with a warning naming it; it stopped the compile (SyntaxError,
    AttributeError) before."""
    _compile_and_train("resnet")
    sources = sorted((rcache.cache_root() / "kernels").glob("k_*.py"))
    assert sources
    for path in sources:
        head = path.read_bytes().split(b"\n", 1)[0].decode().split(" ")
        rcache.write_entry(path, head[1], int(head[2][1:]), source.encode())
    _forget()
    _, warned = _compile_and_train("resnet")
    for path in sources:
        assert any(str(path) in w and "holds other source" in w for w in warned), warned
        assert _valid(path) and source.encode() not in path.read_bytes()


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_numba_cache_is_compiled_again(how):
    _compile_and_train("resnet")
    numba_dir = rcache.cache_root() / "kernels" / "__pycache__"
    index = sorted(numba_dir.glob("*.nbi"))
    data = sorted(numba_dir.glob("*.nbc"))
    assert index and data
    for f in index + data:
        if how == "version":  # Numba's own format: an index written by another Numba version
            if f.suffix == ".nbi":
                rest = f.read_bytes()
                version = pickle.loads(rest)
                f.write_bytes(pickle.dumps("0.0.0") + rest[len(pickle.dumps(version)):])
        else:
            _damage(f, how)
    _forget()
    compiled = nk.compile_count()
    _, warned = _compile_and_train("resnet")
    assert nk.compile_count() > compiled  # compiled again, not loaded
    if how != "version":  # another version's index Numba ignores by itself
        assert _named(warned, numba_dir), warned
    _forget()
    compiled = nk.compile_count()
    _, warned = _compile_and_train("resnet")
    assert nk.compile_count() == compiled and not warned  # the rebuilt cache loads


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_solve_is_solved_again(how, monkeypatch):
    """A HiGHS solve kept by the planner (``remat.plan.solve_cache``) whose entry is damaged is
    solved again, with HiGHS's answer, and its entry written again."""
    from remat.plan import milp, solve_cache

    model = milp._build(*_milp_problem())
    monkeypatch.setattr(solve_cache, "MIN_SECONDS", 0.0)
    first = milp._solve(model, 30.0, 1e-4, node_limit=50)
    (entry,) = solve_cache.cache_dir().glob("*.json")
    _damage(entry, how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = milp._solve(model, 30.0, 1e-4, node_limit=50)
    assert _named([str(w.message) for w in caught], entry)
    assert _valid(entry) and again.fun == first.fun and (again.x == first.x).all()


@pytest.mark.parametrize("x", ["short", "outside"])
def test_a_kept_solve_that_is_not_a_solution_is_solved_again(x, monkeypatch):
    """A whole, checksummed solve entry whose values are not a solution of its model (another
    writer's) is named in a warning and solved again; it crashed the planner (an IndexError, a
    schedule reading a value that is not live)."""
    import json

    from remat.plan import milp, solve_cache

    model = milp._build(*_milp_problem())
    monkeypatch.setattr(solve_cache, "MIN_SECONDS", 0.0)
    first = milp._solve(model, 30.0, 1e-4, node_limit=50)
    (entry,) = solve_cache.cache_dir().glob("*.json")
    head = entry.read_bytes().split(b"\n", 1)[0].decode().split(" ")
    d = json.loads(rcache.check_entry(entry.read_bytes(), head[1], int(head[2][1:]))[0])
    d["x"] = d["x"][:3] if x == "short" else [0.5] * len(d["x"])
    rcache.write_entry(entry, head[1], int(head[2][1:]), json.dumps(d).encode())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = milp._solve(model, 30.0, 1e-4, node_limit=50)
    assert any(str(entry) in str(w.message) and "not a solution" in str(w.message) for w in caught)
    assert again.fun == first.fun and (again.x == first.x).all()


def _milp_problem():
    """A small graph's whole MILP at the middle of its budgets: ``_build``'s arguments."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
    from graphgen import random_graph
    from remat.plan.graph import evaluate, no_remat_schedule
    from remat.plan.greedy import greedy_min_budget
    from remat.plan.scheduling import memory_aware_order

    g = random_graph(8, 3, n_inputs=2, max_fanin=2)
    budget = (greedy_min_budget(g, memory_aware_order(g)) + evaluate(g, no_remat_schedule(g))[1]) // 2
    return g, budget, budget / 1000.0


def test_an_interrupted_write_leaves_the_old_entry_or_none(tmp_path, monkeypatch):
    path = tmp_path / "entries" / "e.bin"
    rcache.write_entry(path, "t", 1, b"old payload")

    def killed(src, dst):
        raise KeyboardInterrupt  # the writer stops between the temporary file and the rename

    monkeypatch.setattr(rcache, "_replace", killed)
    with pytest.raises(KeyboardInterrupt):
        rcache.write_entry(path, "t", 1, b"new payload, longer than the old one")
    with pytest.raises(KeyboardInterrupt):
        rcache.write_entry(tmp_path / "entries" / "new.bin", "t", 1, b"never there")
    assert sorted(p.name for p in path.parent.iterdir()) == ["e.bin"]  # no partial entry, no temporary left
    assert rcache.read_entry(path, "t", 1) == b"old payload"


def test_a_cache_that_cannot_be_written_leaves_no_entry_and_trains(monkeypatch):
    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rcache, "_replace", refused)
    step, warned = _compile_and_train()
    root = rcache.cache_root()
    leftovers = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert not step.report().capture_cached and not leftovers, leftovers


def test_a_foreign_entry_is_named_and_ignored(tmp_path):
    path = tmp_path / "e.json"
    rcache.write_entry(path, "capture:abc", 2, b"{}")
    with pytest.warns(RuntimeWarning, match=str(path)):
        assert rcache.read_entry(path, "capture:def", 2) is None  # another key's entry, moved here
    assert not path.exists()
