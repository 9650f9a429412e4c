"""The capture cache (remat.frontend.capture_cache): a hit gives exactly the program a fresh capture
gives, bound to the live model's tensors; anything the program depends on that changed is a miss."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from remat.frontend import capture_cache
from remat.frontend.torch_import import import_module
from remat.ir import print_module


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    """A cache directory of this test's own."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))


def _model(p: float = 0.25, hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Dropout(p), nn.ReLU(), nn.Linear(hidden, 2))


def _example(batch: int = 3):
    return torch.randn(batch, 4), torch.randn(batch, 2)


def _summary(imp) -> tuple:
    return (print_module(imp.module), imp.param_names, imp.buffer_names, imp.constant_names, imp.output_names,
            imp.input_count, imp.has_seed, imp.input_names)


def _entries() -> list:
    return sorted(capture_cache.cache_dir().glob("*.json")) if capture_cache.cache_dir().exists() else []


def test_a_hit_is_the_fresh_capture_bound_to_the_live_tensors():
    model, ex = _model(), _example()
    fresh = import_module(model, ex, nn.functional.mse_loss, cache=False)
    assert not fresh.from_cache and not _entries()
    first = import_module(model, ex, nn.functional.mse_loss, cache=True)
    assert not first.from_cache and len(_entries()) == 1
    hit = import_module(model, ex, nn.functional.mse_loss, cache=True)
    assert hit.from_cache
    assert _summary(hit) == _summary(fresh)
    live = list(model.parameters())
    assert [id(t) for t in hit._tensors[:len(live)]] == [id(p) for p in live]  # the model's own tensors, not copies


def test_the_environment_variable_turns_the_cache_off(monkeypatch):
    model, ex = _model(), _example()
    monkeypatch.setenv("REMAT_CAPTURE_CACHE", "0")
    import_module(model, ex, nn.functional.mse_loss)
    assert not _entries()
    monkeypatch.setenv("REMAT_CAPTURE_CACHE", "1")
    import_module(model, ex, nn.functional.mse_loss)
    assert len(_entries()) == 1


@pytest.mark.parametrize("change", ["input shape", "attribute", "parameter shape", "eval mode", "loss function",
                                    "requires_grad"])
def test_a_change_the_program_depends_on_is_a_miss(change: str):
    model, ex, loss = _model(), _example(), nn.functional.mse_loss
    base = import_module(model, ex, loss, cache=True)
    train = True
    if change == "input shape":
        ex = _example(batch=5)
    elif change == "attribute":
        model = _model(p=0.5)
    elif change == "parameter shape":
        model = _model(hidden=16)
    elif change == "eval mode":
        train = False
    elif change == "loss function":
        loss = nn.functional.l1_loss
    elif change == "requires_grad":
        model[0].bias.requires_grad_(False)
    got = import_module(model, ex, loss, train=train, cache=True)
    assert not got.from_cache, change
    assert _summary(got) == _summary(import_module(model, ex, loss, train=train, cache=False))
    assert print_module(got.module) != print_module(base.module) or change == "requires_grad"
    assert import_module(model, ex, loss, train=train, cache=True).from_cache  # and now cached in turn


def _user_module(tmp_path, name: str, scale: str):
    """A model class in a file of its own (``SCALE`` a module global its forward reads)."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        SCALE = {scale}

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 2)

            def forward(self, x):
                return helper(self.lin(x))

        def helper(y):
            return y * SCALE
    """))
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    if name in sys.modules:
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def _net(mod):
    torch.manual_seed(0)
    return mod.Net()


def test_edited_model_source_is_a_miss(tmp_path):
    mod = _user_module(tmp_path, "capcache_edited", "2.0")
    ex = _example()
    first = import_module(_net(mod), ex, nn.functional.mse_loss, cache=True)
    assert import_module(_net(mod), ex, nn.functional.mse_loss, cache=True).from_cache
    mod = _user_module(tmp_path, "capcache_edited", "5.0")  # the file edited, the module reloaded
    got = import_module(_net(mod), ex, nn.functional.mse_loss, cache=True)
    assert not got.from_cache
    assert "5.0" in print_module(got.module) and print_module(got.module) != print_module(first.module)


def test_a_changed_module_global_is_a_miss(tmp_path):
    mod = _user_module(tmp_path, "capcache_global", "2.0")
    ex = _example()
    import_module(_net(mod), ex, nn.functional.mse_loss, cache=True)
    mod.SCALE = 3.0
    got = import_module(_net(mod), ex, nn.functional.mse_loss, cache=True)
    assert not got.from_cache and "3.0" in print_module(got.module)


def test_an_edited_file_on_the_stack_of_an_op_is_a_miss(tmp_path):
    """The helper's file is checked by content, even when nothing of the model's own changed."""
    mod = _user_module(tmp_path, "capcache_stack", "2.0")
    ex = _example()
    import_module(_net(mod), ex, nn.functional.mse_loss, cache=True)
    (entry,) = _entries()
    meta = json.loads(entry.read_text().split("\n", 1)[1])  # after the header line
    assert str(tmp_path / "capcache_stack.py") in meta["sources"]
    path = tmp_path / "capcache_stack.py"
    path.write_text(path.read_text() + "\n# edited\n")
    assert not import_module(_net(mod), ex, nn.functional.mse_loss, cache=True).from_cache


class _Opaque:
    __slots__ = ()


def test_an_attribute_it_cannot_describe_leaves_the_model_uncached():
    model, ex = _model(), _example()
    model.opaque = _Opaque()
    with pytest.raises(capture_cache.Uncacheable, match="_Opaque"):
        capture_cache.describe_module(model)
    imp = import_module(model, ex, nn.functional.mse_loss, cache=True)
    assert not imp.from_cache and not _entries()


def test_a_damaged_entry_is_a_miss():
    model, ex = _model(), _example()
    import_module(model, ex, nn.functional.mse_loss, cache=True)
    (entry,) = _entries()
    entry.write_text(entry.read_text()[:100])
    got = import_module(model, ex, nn.functional.mse_loss, cache=True)
    assert not got.from_cache
    assert import_module(model, ex, nn.functional.mse_loss, cache=True).from_cache  # rewritten


def test_lifted_constants_are_kept():
    class WithConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.offset = torch.tensor([0.5, -1.5])  # a plain tensor attribute: lifted as a constant

        def forward(self, x):
            return self.lin(x) + self.offset

    torch.manual_seed(0)
    model, ex = WithConstant(), _example()
    fresh = import_module(model, ex, nn.functional.mse_loss, cache=True)
    hit = import_module(model, ex, nn.functional.mse_loss, cache=True)
    assert fresh.constant_names and hit.from_cache
    assert all(torch.equal(a, b) for a, b in zip(hit.param_tensors(), fresh.param_tensors()))
    model.offset = torch.tensor([0.25, 1.0])  # another value: another key
    assert not import_module(model, ex, nn.functional.mse_loss, cache=True).from_cache


def test_tensors_of_a_loss_module_are_bound_too():
    class ScaledLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, out, y):
            return nn.functional.mse_loss(out, y) * self.scale

    model, ex, loss = _model(), _example(), ScaledLoss()
    fresh = import_module(model, ex, loss, num_targets=1, cache=True)
    hit = import_module(model, ex, loss, num_targets=1, cache=True)
    assert hit.from_cache and _summary(hit) == _summary(fresh)
    assert "loss_fn.scale" in hit.param_names and any(t is loss.scale for t in hit._tensors)


def test_code_digest_does_not_depend_on_reference_counts_or_string_hashing():
    """marshal's bytes change when a constant gains a reference (torch.compile holds on to code
    objects: a fresh process then missed every entry written after a torch.compile) and follow a
    frozenset's hash order; the digest reads neither."""
    import remat
    from remat.frontend.capture_cache import _code_digest

    src = "def f(x):\n    y = ('a long constant string', 2.5)\n    return x in {'p', 'q', 'r'} and y\n"
    ns: dict = {}
    exec(compile(src, "<t>", "exec", dont_inherit=True), ns)
    code = ns["f"].__code__
    before = _code_digest(code)
    held = [c for c in code.co_consts] * 3  # more references to every constant
    assert _code_digest(code) == before and held
    src_dir = os.path.dirname(os.path.dirname(remat.__file__))
    probe = (f"import sys; sys.path.insert(0, {src_dir!r}); from remat.frontend.capture_cache import _code_digest\n"
             f"ns = {{}}; exec(compile({src!r}, '<t>', 'exec'), ns); print(_code_digest(ns['f'].__code__))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        assert out == before
