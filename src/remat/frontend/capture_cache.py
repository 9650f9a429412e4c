"""An on-disk cache of captured models: the translated IR of ``import_module``, so that compiling the
same model again (in this process or a fresh one) neither imports ``torch._dynamo`` nor runs
``torch.export`` and its decompositions.

An entry is found by a key that describes everything the capture reads before tracing, and is
used only if everything the trace read is unchanged:

- the key (:func:`capture_key`): remat's own source (a digest of every ``.py`` file of the
  package, so any change of the importer, of an op or a pass invalidates), the torch and Python
  versions, the working directory (source locations are recorded relative to it), the default
  dtype; the import options (train mode, inputs and targets, keyword names); every example
  input's shape, dtype and ``requires_grad``; and the wrapped model as a value: every submodule's
  class and attributes (numbers, strings, flags, configs, plain tensors by content, functions by
  their compiled code, closures and defaults), the compiled code of every method of the model's
  classes (outside torch), every parameter's and buffer's name, shape, dtype and
  ``requires_grad``, tied parameters, forward hooks; the loss function likewise;
- checked on use (the entry's ``sources``): the content digest of every Python file on the
  stack of any traced op and of every module class's file, and the simple module-level globals
  (numbers, strings, flags) of those files' modules.

What is not described exactly (an object of an unknown kind among the attributes, a global hook,
a non-tensor example input) makes the model uncacheable: it is captured as before. A value the
trace reads that none of the above describes (a dict or list global, a class attribute, an
environment variable read by the forward) is caught by the check on use
(``torch_import.stale_capture``): the cached program's output on the example inputs must match
the model's eager output, else the entry is dropped with a warning and the model captured again.
The check costs one eager and one VM forward (GPT medium on one thread: 2.2 s on a ~0.1 s cached
compile); ``REMAT_CAPTURE_CHECK=0`` skips it, ``REMAT_CAPTURE_CACHE=0`` (or
``import_module(..., cache=False)``) turns the cache off.

Entries live in ``$REMAT_CACHE_DIR/captures`` (default ``~/.cache/remat``), one JSON file per key
(plus the tensors the trace lifted as constants), each written atomically with a header holding
the format version and a SHA-256 of the content (:mod:`remat.cache`): a truncated, corrupted,
foreign or other-version file is ignored with a warning naming it, removed and written again.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import io
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import cache_root, read_entry, switched_on, warn_bad_entry, write_entry

FORMAT = 2
"""The entry format (2: a header with a version and checksum, :mod:`remat.cache`); part of the key."""

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REMAT_DIR = Path(__file__).resolve().parents[1]
_MAX_DEPTH = 8  # nesting of plain objects described (configs of configs ...)


class Uncacheable(Exception):
    """The model holds something the key cannot describe exactly; it is captured without the cache."""


def enabled(cache: bool | None = None) -> bool:
    """Whether captures are cached: ``cache`` if given, else ``$REMAT_CAPTURE_CACHE`` (default on; "0" off)."""
    if cache is not None:
        return bool(cache)
    return switched_on("REMAT_CAPTURE_CACHE")


def checked() -> bool:
    """Whether a capture taken from the cache is checked against the model's eager output before use
    (``torch_import.stale_capture``): ``$REMAT_CAPTURE_CHECK`` (default on; "0" trusts the key)."""
    return switched_on("REMAT_CAPTURE_CHECK")


def cache_dir() -> Path:
    """Where captured models are cached."""
    return cache_root() / "captures"


# ---------------------------------------------------------------- digests
@functools.lru_cache(maxsize=1)
def remat_digest() -> str:
    """A digest of remat's own source (every ``.py`` file of the package): any change invalidates
    every entry."""
    h = hashlib.sha256()
    for p in sorted(_REMAT_DIR.rglob("*.py")):
        h.update(str(p.relative_to(_REMAT_DIR)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


_FILE_DIGESTS: dict[str, tuple[tuple[int, int], str | None]] = {}


def file_digest(path: str) -> str | None:
    """The sha256 of a file's content (None: unreadable), remembered per (mtime, size)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    got = _FILE_DIGESTS.get(path)
    if got is not None and got[0] == stamp:
        return got[1]
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        digest = None
    _FILE_DIGESTS[path] = (stamp, digest)
    return digest


def _code_digest(code: types.CodeType) -> str:
    """A function's compiled code (bytecode, constants, names, nested functions). Not
    ``marshal.dumps``: its bytes depend on reference counts (an object referenced elsewhere is
    written as a back-reference), which ``torch.compile`` changes by holding on to code objects,
    and on the iteration order of frozenset constants, which string hashing randomises per process."""
    return hashlib.sha256(repr(_code_parts(code)).encode()).hexdigest()


def _code_parts(code: types.CodeType) -> tuple:
    return (code.co_name, code.co_code, tuple(_const_parts(c) for c in code.co_consts), code.co_names,
            code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
            code.co_kwonlyargcount, code.co_flags)


def _const_parts(c: Any) -> Any:
    if isinstance(c, types.CodeType):
        return _code_parts(c)
    if isinstance(c, tuple):
        return tuple(_const_parts(v) for v in c)
    if isinstance(c, frozenset):
        return ("frozenset", sorted(repr(_const_parts(v)) for v in c))
    return (type(c).__name__, repr(c))


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


# ---------------------------------------------------------------- describing the model
_PLAIN = (type(None), bool, int, float, str, bytes, complex)


class _Describer:
    """Values as JSON-able descriptions; modules of the model referenced by their path."""

    def __init__(self, module_paths: dict[int, str]):
        self.module_paths = module_paths
        self.stack: set[int] = set()

    def __call__(self, v: Any, depth: int = 0) -> Any:
        if isinstance(v, _PLAIN):
            return [type(v).__name__, repr(v)]
        if depth > _MAX_DEPTH:
            raise Uncacheable(f"attributes nested deeper than {_MAX_DEPTH} levels")
        if isinstance(v, torch.nn.Module):
            path = self.module_paths.get(id(v))
            if path is None:
                raise Uncacheable(f"a {type(v).__name__} that is not a submodule of the model")
            return ["module", path]
        if isinstance(v, torch.Tensor):
            return ["tensor", str(v.dtype), list(v.shape), v.requires_grad, str(v.device), _tensor_digest(v)]
        if isinstance(v, np.ndarray):
            return ["ndarray", str(v.dtype), list(v.shape), hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()]
        if isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return [type(v).__name__, str(v)]
        if isinstance(v, enum.Enum):
            return ["enum", _qualname(type(v)), v.name]
        if isinstance(v, type):
            return ["class", _qualname(v)]
        if isinstance(v, (np.generic,)):
            return ["npscalar", str(v.dtype), repr(v.item())]
        if id(v) in self.stack:
            raise Uncacheable("a cycle among the model's attributes")
        self.stack.add(id(v))
        try:
            return self._container(v, depth)
        finally:
            self.stack.discard(id(v))

    def _container(self, v: Any, depth: int) -> Any:
        d = depth + 1
        if isinstance(v, (tuple, list)):
            return [type(v).__name__, [self(x, d) for x in v]]
        if isinstance(v, dict):
            return [_qualname(type(v)), [[self(k, d), self(x, d)] for k, x in v.items()]]
        if isinstance(v, (set, frozenset)):
            return [type(v).__name__, sorted(json.dumps(self(x, d)) for x in v)]
        if isinstance(v, types.FunctionType):
            cells = [self(c.cell_contents, d) if _filled(c) else ["empty"] for c in (v.__closure__ or ())]
            return ["function", v.__module__, v.__qualname__, _code_digest(v.__code__), cells,
                    self(v.__defaults__, d), self(v.__kwdefaults__, d)]
        if isinstance(v, types.MethodType):
            return ["method", self(v.__self__, d), self(v.__func__, d)]
        if isinstance(v, functools.partial):
            return ["partial", self(v.func, d), self(v.args, d), self(v.keywords, d)]
        if isinstance(v, (types.BuiltinFunctionType, types.BuiltinMethodType)) or _is_torch_op(v):
            owner = getattr(v, "__self__", None)
            if owner is not None and not isinstance(owner, types.ModuleType) and not _is_torch_op(v):
                raise Uncacheable(f"a built-in method bound to a {type(owner).__name__}")
            return ["builtin", getattr(v, "__module__", None) or "", getattr(v, "__qualname__", repr(v))]
        if isinstance(v, types.ModuleType):
            return ["pymodule", v.__name__]
        if hasattr(v, "__dict__") and not callable(v) and type(v).__module__ != "builtins":
            return ["object", _qualname(type(v)), self(dict(vars(v)), d)]
        raise Uncacheable(f"an attribute of type {_qualname(type(v))}")


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _is_torch_op(v: Any) -> bool:
    return isinstance(v, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks", "_global_buffer_registration_hooks",
                 "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")


def describe_module(wrapper: torch.nn.Module) -> dict[str, Any]:
    """The model as a value: submodules (class, attributes, hooks), parameters, buffers, tying."""
    import torch.nn.modules.module as tmm

    for name in _GLOBAL_HOOKS:
        if getattr(tmm, name, None):
            raise Uncacheable(f"a global module hook is registered ({name})")
    named = list(wrapper.named_modules(remove_duplicate=False))
    paths: dict[int, str] = {}
    for path, m in named:
        paths.setdefault(id(m), path)
    describe = _Describer(paths)
    skip = {"_parameters", "_buffers", "_modules"}
    modules = []
    for path, m in named:
        attrs = {k: v for k, v in vars(m).items() if k not in skip}
        modules.append([path, _qualname(type(m)), paths[id(m)], describe(attrs)])
    classes = {_qualname(c): _class_code(c) for _, m in named for c in type(m).__mro__ if _user_class(c)}
    first: dict[int, str] = {}
    params = [[n, str(p.dtype), list(p.shape), p.requires_grad, first.setdefault(id(p), n)]
              for n, p in wrapper.named_parameters(remove_duplicate=False)]
    buffers = [[n, str(b.dtype), list(b.shape), str(b.device)] for n, b in wrapper.named_buffers(remove_duplicate=False)]
    return {"modules": modules, "classes": classes, "parameters": params, "buffers": buffers}


def _user_class(cls: type) -> bool:
    mod = sys.modules.get(cls.__module__)
    f = getattr(mod, "__file__", None)
    return bool(f) and _user_file(os.path.abspath(f))


def _class_code(cls: type) -> dict[str, str]:
    """The compiled code of a class's own methods (as loaded: an edited file not yet reloaded
    differs from it), by name."""
    out = {}
    for k, v in vars(cls).items():
        for f in (v, getattr(v, "__func__", None), getattr(v, "fget", None), getattr(v, "fset", None)):
            if isinstance(f, types.FunctionType):
                out[f"{k}.{f.__name__}"] = _code_digest(f.__code__)
    return out


def capture_key(wrapper: torch.nn.Module, example_inputs: tuple, options: dict[str, Any]) -> str:
    """The key of a capture (see the module's docstring); raises :class:`Uncacheable`."""
    inputs = []
    for t in example_inputs:
        if not isinstance(t, torch.Tensor):
            raise Uncacheable(f"an example input of type {type(t).__name__}")
        inputs.append([str(t.dtype), list(t.shape), t.requires_grad, str(t.device)])
    try:
        model = describe_module(wrapper)
        fields = {"format": FORMAT, "remat": remat_digest(), "torch": torch.__version__,
                  "python": list(sys.version_info[:3]), "cwd": os.getcwd(), "default_dtype": str(torch.get_default_dtype()),
                  "options": options, "inputs": inputs, "model": model}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    except Uncacheable:
        raise
    except Exception as e:  # noqa: BLE001  an attribute that fails to be read or serialised: capture afresh
        raise Uncacheable(f"describing the model failed: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------- what the trace read
def _user_file(path: str) -> bool:
    return not path.startswith(_TORCH_DIR) and not path.startswith("<")


def trace_files(graph: torch.fx.Graph) -> set[str]:
    """Every Python file (outside torch) on the stack of any traced op."""
    import re

    frame = re.compile(r'File "([^"]+)", line \d+')
    files: set[str] = set()
    seen: set[str] = set()
    for node in graph.nodes:
        trace = node.meta.get("stack_trace")
        if not trace or trace in seen:
            continue
        seen.add(trace)
        files.update(f for f in frame.findall(trace) if _user_file(f))
    return files


def class_files(wrapper: torch.nn.Module) -> set[str]:
    """The files defining the classes (and their bases, outside torch) of every submodule."""
    files: set[str] = set()
    for m in wrapper.modules():
        for cls in type(m).__mro__:
            mod = sys.modules.get(cls.__module__)
            f = getattr(mod, "__file__", None)
            if f and _user_file(os.path.abspath(f)):
                files.add(os.path.abspath(f))
    return files


def _modules_of(files: set[str]) -> dict[str, str]:
    """file -> the name of the loaded module defined by it (files of no loaded module are left out)."""
    out: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f:
            f = os.path.abspath(f)
            if f in files and f not in out:
                out[f] = name
    return out


def _simple_globals(module_name: str) -> dict[str, str] | None:
    mod = sys.modules.get(module_name)
    if mod is None:
        return None
    return {k: repr(v) for k, v in sorted(vars(mod).items()) if isinstance(v, _PLAIN) and not k.startswith("__")}


def sources(files: set[str]) -> dict[str, Any]:
    """What an entry checks on use: each file's digest, and its module's simple globals."""
    mods = _modules_of(files)
    return {f: [file_digest(f), mods.get(f), None if f not in mods else _simple_globals(mods[f])] for f in sorted(files)}


def _sources_unchanged(recorded: dict[str, Any]) -> bool:
    for f, (digest, module_name, globals_) in recorded.items():
        if digest is None or file_digest(f) != digest:
            return False
        if module_name is not None and _simple_globals(module_name) != globals_:
            return False
    return True


# ---------------------------------------------------------------- entries
@dataclass
class Entry:
    """A cached capture: the IR text and what ``ImportedModel`` holds besides the tensors."""

    ir: str
    function: str
    state: list[list[str]]  # [kind, target] per leading parameter ("param"/"buffer" of the wrapper, "constant")
    fields: dict[str, Any]  # param_names, buffer_names, input_count, has_seed, output_names, constant_names
    constants: dict[str, torch.Tensor]


def _paths(key: str) -> tuple[Path, Path]:
    d = cache_dir()
    return d / f"{key}.json", d / f"{key}.pt"


_WHAT = "capture cache"


def load(key: str) -> Entry | None:
    """The entry of ``key`` if there is one, whole (:func:`remat.cache.read_entry`: a damaged one is
    ignored with a warning naming its file, and removed), and every source it read is unchanged."""
    meta_path, tensors_path = _paths(key)
    payload = read_entry(meta_path, f"capture:{key}", FORMAT, _WHAT)
    if payload is None:
        return None
    try:
        meta = json.loads(payload)
        state, sources_ = meta["state"], meta["sources"]
        entry = Entry(meta["ir"], meta["function"], state, meta["fields"], {})
        tensors_digest = meta["tensors"]
    except (ValueError, KeyError, TypeError) as e:  # a whole entry of this format always parses: a foreign writer
        warn_bad_entry(meta_path, _WHAT, f"it does not hold a capture ({type(e).__name__}: {e})")
        return None
    if not _sources_unchanged(sources_):
        return None
    if tensors_digest is not None:
        blob = read_entry(tensors_path, f"capture-tensors:{key}", FORMAT, _WHAT)
        if blob is None or hashlib.sha256(blob).hexdigest() != tensors_digest:
            if blob is not None:
                warn_bad_entry(tensors_path, _WHAT, "its tensors are not those its capture was written with")
            return None
        try:
            entry.constants = torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as e:  # noqa: BLE001  checked bytes that torch cannot read: a foreign writer
            warn_bad_entry(tensors_path, _WHAT, f"torch.load failed ({type(e).__name__}: {e})")
            return None
    return entry


def discard(key: str, why: str, keep_quiet: bool = False) -> None:
    """Remove the entry of ``key``, warning that it is not used and why (``keep_quiet``: without a word)."""
    meta_path, tensors_path = _paths(key)
    for p in (tensors_path, meta_path):
        try:
            p.unlink()
        except OSError:
            pass
    if not keep_quiet:
        warn_bad_entry(meta_path, _WHAT, why, remove=False)


def store(key: str, entry: Entry, files: set[str]) -> None:
    """Write ``entry`` under ``key`` (:func:`remat.cache.write_entry`: atomic, versioned, with a
    checksum; the tensors first, their digest in the capture's file). A failure to write leaves no
    entry and is not an error."""
    meta_path, tensors_path = _paths(key)
    blob = None
    if entry.constants:
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in entry.constants.items()}, buf)
        blob = buf.getvalue()
    meta = {"key": key, "ir": entry.ir, "function": entry.function, "state": entry.state,
            "fields": entry.fields, "sources": sources(files),
            "tensors": None if blob is None else hashlib.sha256(blob).hexdigest()}
    try:
        if blob is not None:
            write_entry(tensors_path, f"capture-tensors:{key}", FORMAT, blob)
        write_entry(meta_path, f"capture:{key}", FORMAT, json.dumps(meta).encode())
    except OSError:
        pass
