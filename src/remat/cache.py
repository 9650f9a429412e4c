"""Where remat's on-disk caches live (``$REMAT_CACHE_DIR``, else ``~/.cache/remat``), and how their
entries are written and read.

A module of its own (importing nothing of remat) so that every layer can find the caches without
importing the layer that fills them (the Numba kernels, the workspaces, the captured models).

Every entry is one file: a header line, then the payload. The header names what the entry is (a
tag: the cache and, where the file name is a key, the key), its format version, the payload's
length and its SHA-256::

    #remat-cache <tag> v<version> <bytes> <sha256>\\n<payload>

(a Python comment, so that a cached kernel source is still a module). :func:`write_entry` writes
a temporary file in the entry's directory and renames it over the entry (``os.replace``), so a
writer killed at any point leaves the old entry or the new one, never a part of one.
:func:`read_entry` returns the payload only if the header matches and the payload has its length
and digest: a truncated, empty, corrupted, foreign or other-version entry is ignored with a
``RuntimeWarning`` naming its path, and removed, so that the caller rebuilds it.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

_MAGIC = b"#remat-cache "
_replace = os.replace  # the rename that publishes an entry (a test stops a writer here)


def switched_on(variable: str) -> bool:
    """Whether the environment ``variable`` leaves a cache (or its check) on: unset, or anything
    but "0", "false", "off" or empty."""
    return os.environ.get(variable, "1") not in ("0", "false", "off", "")


def cache_root() -> Path:
    """remat's on-disk caches: ``$REMAT_CACHE_DIR``, else ``~/.cache/remat``."""
    root = os.environ.get("REMAT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "remat"


def header(tag: str, version: int, payload: bytes) -> bytes:
    """The header line of an entry holding ``payload``."""
    if not tag or any(c.isspace() for c in tag):
        raise ValueError(f"a cache tag is one word, got {tag!r}")
    return _MAGIC + f"{tag} v{int(version)} {len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode()


def write_entry(path: str | os.PathLike, tag: str, version: int, payload: bytes) -> None:
    """Write ``payload`` as the entry at ``path`` atomically (a temporary file in the same directory,
    then ``os.replace``); creates the directory. Raises ``OSError`` when it cannot write (the old
    entry, if any, is then left as it was)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header(tag, version, payload))
            f.write(payload)
        _replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def check_entry(data: bytes, tag: str, version: int) -> tuple[bytes | None, str]:
    """``(payload, "")`` if ``data`` is a whole entry of ``tag`` at ``version``, else ``(None, why not)``."""
    if not data:
        return None, "the file is empty"
    end = data.find(b"\n", 0, 512)
    if not data.startswith(_MAGIC[:len(data)]):
        return None, "it is not a remat cache entry (no header)"
    if end < 0:
        return None, "it is truncated (in its header)"
    try:
        got_tag, got_version, size, digest = data[len(_MAGIC):end].decode("ascii").split(" ")
        size_n = int(size)
    except ValueError:
        return None, "its header is malformed"
    if got_tag != tag:
        return None, f"it holds {got_tag!r}, not {tag!r}"
    if got_version != f"v{version}":
        return None, f"it has format {got_version}, not v{version}"
    payload = data[end + 1:]
    if len(payload) != size_n:
        return None, f"it is truncated or extended ({len(payload)} bytes of payload, the header says {size_n})"
    if hashlib.sha256(payload).hexdigest() != digest:
        return None, "its checksum does not match (the file is corrupted)"
    return payload, ""


def read_entry(path: str | os.PathLike, tag: str, version: int, what: str = "cache") -> bytes | None:
    """The payload of the entry at ``path``; None if there is none. A bad entry (see the module's
    docstring) gives None too, with a ``RuntimeWarning`` naming the path and saying why, and is
    removed; ``what`` names the cache in the warning."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warn_bad_entry(path, what, f"it cannot be read ({type(e).__name__}: {e})", remove=False)
        return None
    payload, why = check_entry(data, tag, version)
    if payload is None:
        warn_bad_entry(path, what, why)
    return payload


def warn_bad_entry(path: str | os.PathLike, what: str, why: str, remove: bool = True) -> None:
    """Warn that the cache entry at ``path`` is ignored (and remove it, unless ``remove`` is false)."""
    if remove:
        try:
            os.unlink(path)
        except OSError:
            pass
    warnings.warn(f"remat: ignored the {what} entry {os.fspath(path)}: {why}; it is rebuilt", RuntimeWarning,
                  stacklevel=3)
