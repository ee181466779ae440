"""Writing outputs without ever losing a user's files, and reading back only what checks out.

The rules every ``--out`` of longlab follows (checked *before* any work starts, so a refusal costs nothing
and leaves nothing behind):

- a path that is a file where a directory is wanted (or a directory where a file is wanted), a path under
  a file, or a folder that cannot be written is refused with a :class:`LonglabError` naming the flag;
- an existing, non-empty directory (or an existing file) is replaced only when longlab wrote it — the
  caller's ``owned(path)`` recognises its own artefact (a manifest of the right format and nothing else
  in the directory); anything else is refused and left untouched;
- results are written under a fresh temporary name beside the target (``tempfile``: never a name a user
  file could have) and renamed into place, so a failure (a full disk, an interrupt) leaves the target as
  it was and no temporary behind; a full disk is reported as such, not as a traceback;
- a weights file longlab wrote is read back only after checking it against the record its manifest keeps
  (size, SHA-256, tensor names, shapes and dtypes; finite values): :func:`read_checked_tensors`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .recipe import LonglabError, shorten

__all__ = [
    "read_user_file",
    "read_json",
    "check_output_dir",
    "check_output_file",
    "file_record",
    "file_sha256",
    "publish_dir",
    "read_checked_tensors",
    "tensor_list",
    "write_file_atomic",
    "temp_file_beside",
    "temp_path_beside",
    "save_tensors",
    "new_file_mode",
    "process_umask",
    "os_error",
    "json_format_is",
    "safetensors_format_is",
]

Owned = Callable[[Path], bool]


def json_format_is(path: Path, fmt: str) -> bool:
    """Whether ``path`` is a JSON object whose ``format`` is ``fmt`` (a file longlab wrote as such)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == fmt


def safetensors_format_is(path: Path, fmt: str) -> bool:
    """Whether ``path`` is a safetensors file whose metadata ``format`` is ``fmt``."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            return (fh.metadata() or {}).get("format") == fmt
    except Exception:  # not a safetensors file at all: not ours
        return False


def os_error(exc: OSError, flag: str, path: Path | str, doing: str = "write") -> LonglabError:
    """A clear error for a failed write: a full disk and a read-only folder are named as such."""
    if exc.errno == errno.ENOSPC:
        why = "the disk is full"
    elif exc.errno == errno.EDQUOT:
        why = "the disk quota is exceeded"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "permission denied (read-only?)"
    else:
        why = exc.strerror or str(exc)
    return LonglabError(f"{flag}: cannot {doing} {shorten(str(path))}: {why}; nothing was written")


def _first_existing_parent(path: Path) -> Path:
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _check_parent(path: Path, flag: str) -> None:
    """The folder that will hold ``path`` exists as a directory (or can be made) and is writable."""
    for up in path.parents:
        if up.exists() or up.is_symlink():
            if not up.is_dir():
                raise LonglabError(
                    f"{flag}: {shorten(str(path))} lies under {shorten(str(up))}, which is a file"
                )
            break
    base = _first_existing_parent(path) if not path.parent.exists() else path.parent
    if not os.access(base, os.W_OK | os.X_OK):
        raise LonglabError(f"{flag}: cannot write in {shorten(str(base))} (permission denied or read-only)")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a file"
    return "not a regular file"


def check_output_dir(path: str | os.PathLike[str], flag: str, *, owned: Owned, what: str = "output") -> Path:
    """Check a directory ``--out`` before the work: it does not exist, is empty, or holds longlab's own
    ``what`` (``owned(path)`` is true, so it may be replaced); else raise :class:`LonglabError`. Returns
    the path."""
    out = Path(path)
    try:
        mode = out.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        _check_parent(out, flag)
        return out
    except OSError as exc:
        raise os_error(exc, flag, out, "read") from None
    if not stat.S_ISDIR(mode):
        raise LonglabError(f"{flag}: {shorten(str(out))} is {_kind(mode)}, not a directory")
    try:
        empty = next(out.iterdir(), None) is None
    except OSError as exc:
        raise os_error(exc, flag, out, "read") from None
    if not empty and not owned(out):
        raise LonglabError(
            f"{flag}: {shorten(str(out))} is a directory with files longlab did not write; longlab never "
            f"replaces those: give a new or empty directory for the {what}"
        )
    if not os.access(out, os.W_OK | os.X_OK):
        raise LonglabError(f"{flag}: cannot write in {shorten(str(out))} (permission denied or read-only)")
    _check_parent(out, flag)
    return out


def check_output_file(path: str | os.PathLike[str], flag: str, *, owned: Owned, what: str = "output") -> Path:
    """Check a file ``--out`` before the work: it does not exist or is longlab's own ``what``."""
    out = Path(path)
    try:
        mode = out.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        _check_parent(out, flag)
        return out
    except OSError as exc:
        raise os_error(exc, flag, out, "read") from None
    if not stat.S_ISREG(mode):
        raise LonglabError(f"{flag}: {shorten(str(out))} is {_kind(mode)}; give a file name for the {what}")
    if not owned(out):
        raise LonglabError(
            f"{flag}: {shorten(str(out))} exists and longlab did not write it (as a {what}); longlab never "
            "overwrites such a file: give a new file name"
        )
    _check_parent(out, flag)
    return out


@contextlib.contextmanager
def _temp_dir_beside(out: Path, flag: str) -> Iterator[Path]:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".longlab-tmp", dir=out.parent))
    except OSError as exc:
        raise os_error(exc, flag, out) from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # our own temporary directory, made above


def publish_dir(
    path: str | os.PathLike[str], write: Callable[[Path], None], flag: str, *, owned: Owned,
    last: str | None = None, what: str = "output",
) -> Path:
    """Run ``write(tmp)`` into a fresh temporary directory beside ``path``, then move its files into
    ``path`` (checked again with :func:`check_output_dir`): a new directory is renamed into place whole;
    into an empty or longlab-owned one each file is renamed over its namesake, ``last`` (the manifest)
    after the others, so a reader never sees a new manifest over old data. Files of an owned directory
    that the new output lacks are left where they are. A failure leaves ``path`` as it was."""
    out = check_output_dir(path, flag, owned=owned, what=what)
    with _temp_dir_beside(out, flag) as tmp:
        try:
            write(tmp)
            if not out.exists():
                os.chmod(tmp, 0o777 & ~process_umask())  # mkdtemp made it private; a new folder's mode
                os.rename(tmp, out)
                return out
            names = sorted(p.name for p in tmp.iterdir())
            if last in names:
                names = [n for n in names if n != last] + [last]
            for name in names:
                os.replace(tmp / name, out / name)
        except OSError as exc:
            raise os_error(exc, flag, out) from None
    return out


def process_umask() -> int:
    """The process umask, read without changing it where Linux shows it (``/proc/self/status``): setting
    it to read it back (``os.umask``) would leave another thread's new files world-writable meanwhile."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)  # elsewhere: the briefest, strictest set-and-restore
    os.umask(umask)
    return umask


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file here: ``0o666`` less the process umask."""
    return 0o666 & ~process_umask()


def temp_file_beside(out: Path, suffix: str = ".longlab-tmp", sep: str = ".") -> tuple[int, str]:
    """``(fd, name)`` of a new, uniquely named file beside ``out`` (``tempfile.mkstemp``) with the mode the
    file renamed over ``out`` should keep: ``out``'s own permission bits when it is a file already (a
    replaced output keeps what its owner set), else a new file's usual mode (:func:`new_file_mode`;
    mkstemp alone makes it owner-only)."""
    try:
        mode = stat.S_IMODE(out.stat().st_mode) if out.is_file() else new_file_mode()
    except OSError:
        mode = new_file_mode()
    fd, name = tempfile.mkstemp(prefix=f".{out.name}{sep}", suffix=suffix, dir=out.parent)
    try:
        os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        os.unlink(name)  # the file mkstemp just made for us (a new, unique name), never ``out``
        raise
    return fd, name


def temp_path_beside(out: Path, suffix: str = ".longlab-tmp") -> Path:
    """:func:`temp_file_beside`, closed: the path, for a writer that opens it by name."""
    fd, name = temp_file_beside(out, suffix)
    os.close(fd)
    return Path(name)


def save_tensors(tensors: Mapping[str, Any], path: str | os.PathLike[str],
                 metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, keeping the mode ``path`` had (a :func:`temp_path_beside` file has
    its target's) or else giving a new file's usual mode (:func:`new_file_mode`): safetensors re-creates its
    file owner-only (0o600), unlike every other file longlab writes."""
    from safetensors.torch import save_file

    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = new_file_mode()
    save_file(dict(tensors), str(path), metadata=metadata)
    os.chmod(path, mode)


def write_file_atomic(path: str | os.PathLike[str], data: str | bytes, flag: str) -> Path:
    """Write ``data`` to a unique temporary file beside ``path`` (:func:`temp_file_beside`) and rename it
    over ``path``."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = temp_file_beside(out)
    except OSError as exc:
        raise os_error(exc, flag, out) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(name, out)
    except OSError as exc:
        raise os_error(exc, flag, out) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)  # our own temporary file (gone already once renamed)
    return out


def read_user_file(path: str | os.PathLike[str], flag: str, max_bytes: int = 64 << 20) -> bytes:
    """The bytes of a file a user named, checked first: a regular file (not a directory, a FIFO that would
    block forever, or a device), at most ``max_bytes`` long, readable."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise LonglabError(f"{flag}: no such file: {shorten(str(p))}") from None
    except OSError as exc:
        raise os_error(exc, flag, p, "read") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe or a device)"
        raise LonglabError(f"{flag}: {shorten(str(p))} is {kind}; give a file")
    if st.st_size > max_bytes:
        raise LonglabError(f"{flag}: {shorten(str(p))} has {st.st_size:,} bytes, more than {max_bytes:,}")
    try:
        with open(p, "rb") as fh:
            return fh.read(max_bytes + 1)
    except OSError as exc:
        raise os_error(exc, flag, p, "read") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def read_json(path: str | os.PathLike[str], flag: str, max_bytes: int = 64 << 20) -> object:
    """A JSON file a user named, parsed strictly: :func:`read_user_file`'s checks, UTF-8, no ``NaN`` or
    ``Infinity``, not nested deeper than Python can parse; any fault is a :class:`LonglabError`."""
    import json

    data = read_user_file(path, flag, max_bytes)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise LonglabError(f"{flag}: {shorten(str(path))} is not UTF-8 text (byte {err.start})") from None
    except RecursionError:
        raise LonglabError(f"{flag}: {shorten(str(path))} is nested too deeply to be JSON data") from None
    except ValueError as err:
        raise LonglabError(f"{flag}: {shorten(str(path))} is not JSON ({err})") from None


# --------------------------------------------------------------------------------------------------
# Reading: a file longlab wrote is checked against its manifest's record before it is trusted.
#
# The record of a weights file (``file_record``) is its size, its SHA-256 and its tensor list (name ->
# shape, dtype). ``read_checked_tensors`` refuses, with a LonglabError naming the file and what is wrong,
# anything that is not a regular file, a file of another size (truncated, partial), another digest (corrupt,
# edited, rescaled), a tensor list other than the record's, and non-finite values (checked even when the
# digest matches: a record written over bad weights proves nothing).

_HEX = frozenset("0123456789abcdef")
_CHUNK = 1 << 22


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tensor_list(tensors: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: {"shape": [...], "dtype": "float32"}}`` of a tensor dictionary, names sorted."""
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in sorted(tensors.items())
    }


def file_record(path: str | os.PathLike[str], tensors: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's record of a file just written: ``bytes``, ``sha256`` and (given the tensors saved in
    it) ``tensors``, their :func:`tensor_list`."""
    record: dict[str, Any] = {"bytes": os.stat(path).st_size, "sha256": file_sha256(path)}
    if tensors is not None:
        record["tensors"] = tensor_list(tensors)
    return record


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"it is {type(record).__name__}, not an object"
    size, sha, tensors = record.get("bytes"), record.get("sha256"), record.get("tensors")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"bytes={shorten(size)} is not a size"
    if not isinstance(sha, str) or len(sha) != 64 or not set(sha) <= _HEX:
        return f"sha256={shorten(sha)} is not a SHA-256 hex digest"
    if not isinstance(tensors, dict) or not tensors:
        return "it lists no tensors"
    for name, spec in tensors.items():
        shape = spec.get("shape") if isinstance(spec, dict) else None
        dims_ok = isinstance(shape, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
        if not dims_ok or not isinstance(spec.get("dtype"), str):
            return f"tensor {shorten(name)} has no valid shape/dtype"
    return None


def read_checked_tensors(
    path: str | os.PathLike[str], record: Any, *, what: str, fix: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors and metadata of the safetensors file ``path``, after checking it against ``record``
    (see :func:`file_record`): a regular file of ``record["bytes"]`` bytes whose SHA-256 is
    ``record["sha256"]``, holding exactly the tensors of ``record["tensors"]`` (names, shapes, dtypes),
    every floating value finite. Else a :class:`LonglabError` ``"{what}: <what is wrong>; {fix}"``."""
    from safetensors import SafetensorError, safe_open

    def refuse(reason: str) -> LonglabError:
        return LonglabError(f"{what}: {reason}; {fix}")

    problem = _record_problem(record)
    if problem:
        raise refuse(f"the manifest's record of {Path(path).name} is malformed ({problem})")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise refuse(f"{Path(path).name} is missing") from None
    except OSError as exc:
        raise refuse(f"cannot read {Path(path).name} ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise refuse(f"{Path(path).name} is {_kind(st.st_mode)}, not a weights file")
    want = record["bytes"]
    if st.st_size != want:
        how = "truncated or partial" if st.st_size < want else "longer than written"
        raise refuse(f"{Path(path).name} has {st.st_size:,} bytes, the manifest says {want:,} ({how})")
    try:
        digest = file_sha256(path)
    except OSError as exc:
        raise refuse(f"cannot read {Path(path).name} ({exc.strerror or exc})") from None
    if digest != record["sha256"]:
        raise refuse(
            f"{Path(path).name} does not match the SHA-256 in its manifest (corrupt, or changed after "
            f"longlab wrote it: {digest[:16]}... against {record['sha256'][:16]}...)"
        )
    try:
        with safe_open(str(path), "pt") as fh:
            meta = dict(fh.metadata() or {})
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise refuse(f"{Path(path).name} is not a readable safetensors file ({type(exc).__name__})") from None
    listed = record["tensors"]
    missing = sorted(set(listed) - set(tensors))
    extra = sorted(set(tensors) - set(listed))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the {len(listed)} listed tensors missing (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} unlisted (e.g. {extra[0]})")
        raise refuse(f"{Path(path).name} does not hold the manifest's tensors: {'; '.join(parts)}")
    found = tensor_list(tensors)
    for name, spec in listed.items():
        if found[name] != {"shape": spec["shape"], "dtype": spec["dtype"]}:
            raise refuse(
                f"tensor {name} in {Path(path).name} is {found[name]['dtype']} {found[name]['shape']}, "
                f"the manifest says {spec['dtype']} {spec['shape']}"
            )
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(_finite(t)):
            raise refuse(f"tensor {name} in {Path(path).name} has non-finite values (NaN or inf)")
    return tensors, meta


def _finite(t: Any) -> bool:
    """Every value of the tensor ``t`` is finite."""
    import torch

    return bool(torch.isfinite(t).all())
