"""Compile-on-first-use for longlab's C++ kernels: the one builder of every kernel in :mod:`longlab.ops`.

A kernel is a :class:`Kernel` (name, C++ sources, flags, the environment switch that turns it off, the
symbols it must export). :func:`load` returns the compiled module, building it once per machine into
``cache_dir() / "kernels"``, or None with a reason (:func:`reason`) when it cannot, so that every caller
falls back to its pure-PyTorch path. What can go wrong with a build, and what the builder does about it:

- **A build killed midway.** The lock that serialises builds is an ``flock`` on ``NAME.lock`` (released by
  the kernel when its holder dies, so a killed build never leaves a lock that blocks); its file records
  the holder's pid and start time. Waiting is bounded (``LONGLAB_BUILD_WAIT_S``, default 600 s) and
  re-checks the holder on every poll: a dead holder or one building for longer than
  ``LONGLAB_BUILD_STALE_S`` (default 900 s) is taken over. A taken-over build cannot collide with the
  old one: every build compiles in a private directory and installs by an atomic rename.
- **A truncated or corrupt library.** The installed ``.so`` is named by its content key and comes with
  a manifest (``NAME-KEY.json``: size and SHA-256 recorded at install). Before a process loads it, the
  size and digest are checked (a truncated file is never mapped, so never a SIGBUS); a mismatch, a
  missing or malformed manifest deletes both files (longlab's own, in longlab's cache) and rebuilds.
  A freshly built library is imported **in a subprocess** (:data:`_VERIFY`) before it is installed,
  so a library that crashes on import is refused without taking the caller down.
- **Stray compiler processes.** The compiler runs in a child process that leads its own process group
  (``longlab.ops._compile``); on a timeout (``LONGLAB_BUILD_TIMEOUT_S``, default 900 s), an error or
  an interrupt the builder kills the whole group, and the child kills its group itself when its parent
  dies (it watches ``getppid``), so no ``ninja``/``cc1plus`` outlives a killed run. Private build
  directories of dead builds are removed by the next build.

The content key hashes the sources, flags, torch version, CPU capability and Python version, so an
edited source is rebuilt. A kernel is switched off with its environment variable set to ``0``
(``LONGLAB_BLOCK_FLASH=0``, ``LONGLAB_QDECODE=0``), read at every call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from longlab.paths import cache_dir

try:  # POSIX; elsewhere builds are not serialised (each compiles privately and installs atomically)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["Kernel", "load", "reason", "cpu_flags", "kernel_dir", "MANIFEST_FORMAT", "BuildError"]

MANIFEST_FORMAT = "longlab.kernel/1"
_POLL_S = 0.2


class BuildError(RuntimeError):
    """A kernel could not be built or verified (the message says why)."""


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


def cpu_flags() -> list[str]:
    """Compiler flags for what ATen's own kernels run here (AVX512, AVX2, else the defaults)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return ["-O3", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw",
                "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
    if cap == "AVX2":
        return ["-O3", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"]
    return ["-O3"]


@dataclass(frozen=True)
class Kernel:
    """A C++ extension of longlab: ``sources`` compiled with ``cflags``; it must export ``symbols``.
    ``env``: the variable that switches it off (``0``); ``preload``: modules its library needs loaded
    first (torch, for its shared libraries); ``command``: a plain build command in place of
    ``torch.utils.cpp_extension`` (``{name}``: the module name, ``{workdir}``: where ``{name}.so`` goes)."""

    name: str
    sources: tuple[Path, ...]
    env: str
    symbols: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    preload: tuple[str, ...] = ("torch",)
    command: tuple[str, ...] = ()  # an argv that builds it instead of torch's compiler ({name}, {workdir})

    @functools.cached_property
    def key(self) -> str:
        """Content key: sources, flags, torch version, CPU capability, Python version."""
        h = hashlib.sha256()
        for src in self.sources:
            h.update(Path(src).read_bytes())
        h.update("\0".join((*self.cflags, torch.__version__, torch.backends.cpu.get_cpu_capability(),
                            sys.version.split()[0], *self.preload, *self.command)).encode())
        return h.hexdigest()[:16]

    @property
    def module_name(self) -> str:
        """The extension's Python module name (its ``PyInit_`` symbol); unique per content key."""
        return f"longlab_{self.name}_{self.key}"


_LOADED: dict[str, ModuleType] = {}
_FAILED: dict[str, str] = {}


def kernel_dir() -> Path:
    """Where built kernels live: ``cache_dir() / "kernels"``."""
    return cache_dir() / "kernels"


def reason(kernel: Kernel) -> str | None:
    """Why ``kernel`` cannot be used in this process (None: it is loaded, building it if needed)."""
    load(kernel)
    if os.environ.get(kernel.env, "1") == "0":
        return f"disabled by {kernel.env}=0"
    return _FAILED.get(kernel.key)


def load(kernel: Kernel) -> ModuleType | None:
    """The compiled module of ``kernel``, built on first use (module docstring); None when it is switched
    off (``kernel.env=0``) or cannot be built here (then :func:`reason` says why, and a warning is given
    once per process)."""
    if os.environ.get(kernel.env, "1") == "0":
        return None
    key = kernel.key
    if key in _LOADED:
        return _LOADED[key]
    if key in _FAILED:
        return None
    try:
        module = _load_or_build(kernel)
    except Exception as exc:  # no compiler, a failed or refused build: the caller's fallback runs
        _FAILED[key] = f"could not build longlab/ops/{kernel.sources[0].name} ({type(exc).__name__}: {exc})"
        warnings.warn(f"{_FAILED[key]}; using the PyTorch path", RuntimeWarning, stacklevel=3)
        return None
    _LOADED[key] = module
    return module


# --- installed artefacts ----------------------------------------------------------------------------
def _paths(kernel: Kernel) -> tuple[Path, Path]:
    d = kernel_dir()
    stem = f"{kernel.name}-{kernel.key}"
    return d / f"{stem}.so", d / f"{stem}.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_installed(kernel: Kernel) -> str | None:
    """None when the installed library matches its manifest; else what is wrong ("absent" if nothing is
    installed)."""
    so, manifest = _paths(kernel)
    if not so.exists() and not manifest.exists():
        return "absent"
    try:
        if manifest.stat().st_size > 1 << 16:
            return "manifest too large"
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"unreadable manifest ({type(exc).__name__})"
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        return "not a longlab kernel manifest"
    if data.get("key") != kernel.key or data.get("module") != kernel.module_name:
        return "manifest of another build"
    size, digest = data.get("size"), data.get("sha256")
    if not isinstance(size, int) or not isinstance(digest, str) or data.get("verified") is not True:
        return "incomplete manifest"
    try:
        actual = so.stat().st_size
    except OSError:
        return "library missing"
    if actual != size:
        return f"library is {actual} bytes, {size} were installed (truncated or replaced)"
    if _sha256(so) != digest:
        return "library digest differs from the one installed (corrupt)"
    return None


def _remove_installed(kernel: Kernel) -> None:
    for p in _paths(kernel):  # both named by this kernel's key, in longlab's own cache directory
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _import(kernel: Kernel, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(kernel.module_name, str(path))
    spec = importlib.util.spec_from_file_location(kernel.module_name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    missing = [s for s in kernel.symbols if not hasattr(module, s)]
    if missing:
        raise BuildError(f"{path.name} does not export {missing}")
    return module


def _load_or_build(kernel: Kernel) -> ModuleType:
    so, _ = _paths(kernel)
    if _check_installed(kernel) is None:
        return _import(kernel, so)
    kernel_dir().mkdir(parents=True, exist_ok=True)
    with _build_lock(kernel) as held:
        problem = _check_installed(kernel)  # someone may have built it while we waited
        if problem is None:
            return _import(kernel, so)
        if problem != "absent":
            if held:
                _remove_installed(kernel)
            print(f"longlab: the built {kernel.name} kernel is not usable ({problem}); rebuilding",
                  file=sys.stderr, flush=True)
        if held:
            _remove_dead_workdirs(kernel)
        _build_and_install(kernel)
    return _import(kernel, so)


# --- the lock ---------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_owner(fd: int) -> tuple[int, float] | None:
    try:
        raw = os.pread(fd, 256, 0)
        data = json.loads(raw.decode("ascii"))
        return int(data["pid"]), float(data["since"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


@contextlib.contextmanager
def _build_lock(kernel: Kernel) -> Iterator[bool]:
    """Hold ``NAME.lock`` while building; yields True when held, False when the wait was given up
    (bounded wait, dead or stale holder: the caller builds privately, installing atomically)."""
    if fcntl is None:  # pragma: no cover
        yield False
        return
    path = kernel_dir() / f"{kernel.name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        wait_s = _env_seconds("LONGLAB_BUILD_WAIT_S", 600.0)
        stale_s = _env_seconds("LONGLAB_BUILD_STALE_S", 900.0)
        start, told, held = time.monotonic(), False, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                pass
            if _check_installed(kernel) is None:  # the holder finished: nothing to build
                break
            owner = _read_owner(fd)
            waited = time.monotonic() - start
            if owner is not None and (not _pid_alive(owner[0]) or time.time() - owner[1] > stale_s):
                print(f"longlab: taking over the {kernel.name} build of pid {owner[0]} (dead or stale)",
                      file=sys.stderr, flush=True)
                break
            if waited > wait_s:
                print(f"longlab: waited {waited:.0f} s for the {kernel.name} build lock; building apart",
                      file=sys.stderr, flush=True)
                break
            if not told and waited > 2.0:
                who = f"pid {owner[0]}" if owner else "another process"
                print(f"longlab: waiting for {who} to build the {kernel.name} kernel", file=sys.stderr,
                      flush=True)
                told = True
            time.sleep(_POLL_S)
        if held:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": time.time()}).encode("ascii"), 0)
        yield held
    finally:
        if held:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


# --- building ---------------------------------------------------------------------------------------
_WORK_PREFIX = "build-"


def _remove_dead_workdirs(kernel: Kernel) -> None:
    """Private build directories (``build-NAME-PID-*``, ours) whose builder is dead."""
    for d in kernel_dir().glob(f"{_WORK_PREFIX}{kernel.name}-*"):
        try:
            pid = int(d.name[len(_WORK_PREFIX) + len(kernel.name) + 1:].split("-", 1)[0])
        except ValueError:
            continue
        if d.is_dir() and not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _compile_command(kernel: Kernel, workdir: Path) -> list[str]:
    """The child process that compiles ``kernel`` into ``workdir / (module_name + ".so")``
    (:mod:`longlab.ops._compile`)."""
    spec = {"name": kernel.module_name, "sources": [str(s) for s in kernel.sources],
            "cflags": list(kernel.cflags), "workdir": str(workdir), "parent": os.getpid(),
            "command": [a.format(name=kernel.module_name, workdir=workdir) for a in kernel.command]}
    return [sys.executable, str(Path(__file__).with_name("_compile.py")), json.dumps(spec)]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


def _run_group(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` as the leader of a new process group; the whole group is killed on a timeout, an
    error or an interrupt (KeyboardInterrupt included)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BuildError(f"{what} did not finish in {timeout:.0f} s (LONGLAB_BUILD_TIMEOUT_S)") from None
    except BaseException:
        _kill_group(proc)
        raise
    # the leader has exited: anything it left in its group (a compiler it did not wait for) goes too
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out.decode(errors="replace"), "")


# Imports a built library in a fresh interpreter: argv = path, module name, preload (comma-separated),
# symbols (comma-separated). Prints the marker on success.
_VERIFY = """
import importlib.machinery, importlib.util, sys
path, name, preload, symbols = sys.argv[1:5]
for m in filter(None, preload.split(",")):
    __import__(m)
loader = importlib.machinery.ExtensionFileLoader(name, path)
spec = importlib.util.spec_from_file_location(name, path, loader=loader)
mod = importlib.util.module_from_spec(spec)
loader.exec_module(mod)
missing = [s for s in filter(None, symbols.split(",")) if not hasattr(mod, s)]
if missing:
    raise SystemExit("missing symbols: %s" % missing)
print("longlab-kernel-ok")
"""


def _verify(kernel: Kernel, path: Path) -> None:
    """Import ``path`` in a subprocess; raises :class:`BuildError` unless it imports and exports the
    kernel's symbols (a crash on import, e.g. SIGBUS on a bad file, only kills the subprocess)."""
    cmd = [sys.executable, "-c", _VERIFY, str(path), kernel.module_name, ",".join(kernel.preload),
           ",".join(kernel.symbols)]
    res = _run_group(cmd, _env_seconds("LONGLAB_VERIFY_TIMEOUT_S", 120.0), f"importing {path.name}")
    if res.returncode != 0 or "longlab-kernel-ok" not in res.stdout:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit {res.returncode}"
        raise BuildError(f"{path.name} does not import ({how}): {res.stdout.strip()[-500:]}")


def _build_and_install(kernel: Kernel) -> None:
    so, manifest = _paths(kernel)
    workdir = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}{kernel.name}-{os.getpid()}-", dir=kernel_dir()))
    try:
        print(f"longlab: building the {kernel.name} kernel once into {kernel_dir()} (about a minute)",
              file=sys.stderr, flush=True)
        timeout = _env_seconds("LONGLAB_BUILD_TIMEOUT_S", 900.0)
        res = _run_group(_compile_command(kernel, workdir), timeout, f"building {kernel.name}")
        built = workdir / f"{kernel.module_name}.so"
        if res.returncode != 0 or not built.is_file():
            raise BuildError(f"compiler exit {res.returncode}: {res.stdout.strip()[-800:]}")
        _verify(kernel, built)
        record = {"format": MANIFEST_FORMAT, "kernel": kernel.name, "key": kernel.key,
                  "module": kernel.module_name, "file": so.name, "size": built.stat().st_size,
                  "sha256": _sha256(built), "verified": True, "torch": torch.__version__,
                  "built": time.strftime("%Y-%m-%d %H:%M:%S")}
        staged = workdir / "manifest.json"
        staged.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(built, so)  # atomic within the cache directory: readers see all of it or nothing
        os.replace(staged, manifest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
