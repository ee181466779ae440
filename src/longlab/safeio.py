"""Writing outputs without ever losing a user's files.

The rules every ``--out`` of longlab follows (checked *before* any work starts, so a refusal costs nothing
and leaves nothing behind):

- a path that is a file where a directory is wanted (or a directory where a file is wanted), a path under
  a file, or a folder that cannot be written is refused with a :class:`LonglabError` naming the flag;
- an existing, non-empty directory (or an existing file) is replaced only when longlab wrote it — the
  caller's ``owned(path)`` recognises its own artefact (a manifest of the right format and nothing else
  in the directory); anything else is refused and left untouched;
- results are written under a fresh temporary name beside the target (``tempfile``: never a name a user
  file could have) and renamed into place, so a failure (a full disk, an interrupt) leaves the target as
  it was and no temporary behind; a full disk is reported as such, not as a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .recipe import LonglabError, shorten

__all__ = [
    "read_user_file",
    "read_json",
    "check_output_dir",
    "check_output_file",
    "publish_dir",
    "write_file_atomic",
    "os_error",
]

Owned = Callable[[Path], bool]


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
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; give it a new folder's mode
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


def write_file_atomic(path: str | os.PathLike[str], data: str | bytes, flag: str) -> Path:
    """Write ``data`` to a unique temporary file beside ``path`` and rename it over ``path``."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".longlab-tmp", dir=out.parent)
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
