"""The kernel builder (longlab.ops.build) under the failures of issue 28: a stale lock, a truncated or
corrupt library, a build killed midway. A tiny C extension built by ``gcc`` stands in for torch's compiler
(well under a second per build), through the builder's real child process and lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from longlab.ops import build

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or not hasattr(os, "killpg"),
                                reason="needs gcc and POSIX process groups")

SRC = Path(__file__).resolve().parents[1] / "src"

_C = """
#include <Python.h>
static PyObject* ping(PyObject* self, PyObject* args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"ping", ping, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, MODNAME_STR, NULL, -1, methods};
PyMODINIT_FUNC PyInit_MODNAME(void) { return PyModule_Create(&mod); }
"""

# the stand-in compiler: optional delay in a grandchild (records pids), then gcc; counts its builds
_FAKE_CC = """
import os, subprocess, sys, sysconfig, time
name, workdir, src, log = sys.argv[1:5]
delay = float(os.environ.get("FAKE_CC_DELAY", "0"))
with open(log, "a") as f:
    f.write("build %d\\n" % os.getpid())
if delay:
    child = subprocess.Popen(["sleep", str(delay)])
    with open(log, "a") as f:
        f.write("pids %d %d\\n" % (os.getpid(), child.pid))
    child.wait()
code = open(src).read().replace("MODNAME_STR", '"%s"' % name).replace("MODNAME", name)
c = os.path.join(workdir, "m.c")
open(c, "w").write(code)
inc = sysconfig.get_paths()["include"]
sys.exit(subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-I" + inc, c, "-o",
                         os.path.join(workdir, name + ".so")]).returncode)
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A Kernel built by the stand-in compiler into a private LONGLAB_CACHE; returns (kernel, log path)."""
    monkeypatch.setenv("LONGLAB_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "fake.c"
    src.write_text(_C + f"/* {tmp_path} */\n")  # a key (and module name) of its own per test
    cc = tmp_path / "fake_cc.py"
    cc.write_text(_FAKE_CC)
    log = tmp_path / "cc.log"
    log.write_text("")
    kernel = build.Kernel("fake", (src,), "LONGLAB_FAKE_KERNEL", ("ping",), preload=(),
                          command=(sys.executable, str(cc), "{name}", "{workdir}", str(src), str(log)))
    yield kernel, log
    build._LOADED.pop(kernel.key, None)
    build._FAILED.pop(kernel.key, None)


def _builds(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.startswith("build "))


def _forget(kernel: build.Kernel) -> None:
    """As if in a new process: nothing loaded or failed yet."""
    build._LOADED.pop(kernel.key, None)
    build._FAILED.pop(kernel.key, None)


def _run_loader(kernel: build.Kernel, env: dict | None = None, timeout: float = 60) -> subprocess.Popen:
    """A separate process that loads ``kernel`` and prints ``ping()`` (so a bad library can only kill it)."""
    code = textwrap.dedent(f"""
        import sys, types
        from pathlib import Path
        pkg = types.ModuleType("longlab")  # only longlab.paths and longlab.ops, not the whole package
        pkg.__path__ = [{str(SRC / "longlab")!r}]
        sys.modules["longlab"] = pkg
        from longlab.ops import build
        k = build.Kernel("fake", (Path({str(kernel.sources[0])!r}),), "LONGLAB_FAKE_KERNEL", ("ping",),
                         preload=(), command={kernel.command!r})
        m = build.load(k)
        print("PING", m.ping() if m is not None else build.reason(k), flush=True)
    """)
    full = dict(os.environ, PYTHONPATH=str(SRC), LONGLAB_BUILD_WAIT_S="300", **(env or {}))
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_builds_once_verifies_and_records_size_and_digest(fake):
    kernel, log = fake
    module = build.load(kernel)
    assert module is not None and module.ping() == 42
    so, manifest = build._paths(kernel)
    record = json.loads(manifest.read_text())
    assert record["size"] == so.stat().st_size and record["sha256"] == build._sha256(so)
    assert record["verified"]
    _forget(kernel)
    assert build.load(kernel).ping() == 42
    assert _builds(log) == 1  # the second process-level load reuses the checked library
    assert not list(build.kernel_dir().glob("build-*"))  # no private build directory left


def test_a_truncated_library_is_rebuilt_never_loaded(fake):
    kernel, log = fake
    proc = _run_loader(kernel)
    assert "PING 42" in proc.communicate(timeout=120)[0]
    so, _ = build._paths(kernel)
    data = so.read_bytes()
    so.write_bytes(data[: len(data) // 2])  # a copy interrupted half way (a full disk, a killed cp)
    assert "truncated" in build._check_installed(kernel)
    out = _run_loader(kernel).communicate(timeout=120)[0]
    assert "PING 42" in out, out  # loaded after a rebuild: no SIGBUS, no ImportError
    assert _builds(log) == 2
    assert build._check_installed(kernel) is None


@pytest.mark.parametrize("damage", ["corrupt", "no-manifest", "bad-manifest"])
def test_a_corrupt_library_or_manifest_is_rebuilt(fake, damage):
    kernel, log = fake
    assert build.load(kernel).ping() == 42
    so, manifest = build._paths(kernel)
    if damage == "corrupt":  # same size, different bytes; a new file (the mapped one stays intact)
        data = so.read_bytes()
        fresh = so.with_suffix(".new")
        fresh.write_bytes(data[:1000] + bytes(b ^ 0xFF for b in data[1000:2000]) + data[2000:])
        os.replace(fresh, so)
    elif damage == "no-manifest":
        manifest.unlink()
    else:
        manifest.write_text('{"format": "longlab.kernel/1", "size": "big"}')
    assert build._check_installed(kernel) is not None
    _forget(kernel)
    assert build.load(kernel) is not None
    assert _builds(log) == 2
    assert build._check_installed(kernel) is None


def test_a_library_that_does_not_import_is_refused_with_a_reason(fake, monkeypatch):
    kernel, log = fake
    bad = build.Kernel(kernel.name, kernel.sources, kernel.env, ("ping", "missing_symbol"), preload=(),
                       command=kernel.command)
    with pytest.warns(RuntimeWarning, match="missing_symbol"):
        assert build.load(bad) is None
    assert "missing_symbol" in build.reason(bad)
    assert not build._paths(bad)[0].exists()  # nothing installed
    _forget(bad)


def test_switched_off_by_its_environment_variable(fake, monkeypatch):
    kernel, log = fake
    monkeypatch.setenv("LONGLAB_FAKE_KERNEL", "0")
    assert build.load(kernel) is None
    assert build.reason(kernel) == "disabled by LONGLAB_FAKE_KERNEL=0"
    assert _builds(log) == 0


def _hold_lock(kernel: build.Kernel, since: float) -> subprocess.Popen:
    """A live process holding the kernel's build lock (flock), recording ``since`` as its start."""
    lock = build.kernel_dir() / f"{kernel.name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    code = textwrap.dedent(f"""
        import fcntl, json, os, sys, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, json.dumps({{"pid": os.getpid(), "since": {since}}}).encode(), 0)
        print("held", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_left_by_a_dead_build_does_not_block(fake):
    kernel, log = fake
    lock = build.kernel_dir() / f"{kernel.name}.lock"
    lock.parent.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "since": time.time() - 5}))  # its holder is gone
    start = time.monotonic()
    assert build.load(kernel).ping() == 42
    assert time.monotonic() - start < 60


def test_a_stale_lock_held_by_a_live_process_is_taken_over(fake, monkeypatch):
    kernel, log = fake
    monkeypatch.setenv("LONGLAB_BUILD_WAIT_S", "300")
    holder = _hold_lock(kernel, since=time.time() - 10_000)  # building for 3 hours: stuck
    try:
        start = time.monotonic()
        assert build.load(kernel).ping() == 42  # the wait bound is 300 s: must not wait for it
        assert time.monotonic() - start < 60
    finally:
        holder.kill()
        holder.wait()


def test_the_wait_for_a_live_lock_is_bounded(fake, monkeypatch):
    kernel, log = fake
    monkeypatch.setenv("LONGLAB_BUILD_WAIT_S", "1")
    holder = _hold_lock(kernel, since=time.time())  # a fresh build that never finishes
    try:
        start = time.monotonic()
        assert build.load(kernel).ping() == 42  # built apart after ~1 s, installed atomically
        assert 0.9 < time.monotonic() - start < 60
    finally:
        holder.kill()
        holder.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_build_killed_midway_leaves_no_compiler_and_no_block(fake):
    kernel, log = fake
    proc = _run_loader(kernel, env={"FAKE_CC_DELAY": "60"})
    deadline = time.monotonic() + 120
    while "pids" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the stand-in compiler never started"
        time.sleep(0.05)
    cc_pid, sleep_pid = (int(x) for x in log.read_text().split("pids ")[1].split()[:2])
    assert _alive(cc_pid) and _alive(sleep_pid)
    proc.send_signal(signal.SIGKILL)  # kill -9 of the run that builds
    proc.wait()
    deadline = time.monotonic() + 5
    while (_alive(cc_pid) or _alive(sleep_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(cc_pid) and not _alive(sleep_pid), "the killed build's compiler processes live on"
    start = time.monotonic()
    out = _run_loader(kernel).communicate(timeout=120)[0]  # the next run neither waits nor fails
    assert "PING 42" in out, out
    assert time.monotonic() - start < 100  # its wait bound is 300 s
    assert not list(build.kernel_dir().glob("build-*"))  # the dead build's private directory is gone


def test_a_build_past_its_timeout_is_killed_with_its_children(fake, monkeypatch):
    kernel, log = fake
    monkeypatch.setenv("LONGLAB_BUILD_TIMEOUT_S", "1")
    monkeypatch.setenv("FAKE_CC_DELAY", "60")
    with pytest.warns(RuntimeWarning, match="did not finish"):
        assert build.load(kernel) is None
    cc_pid, sleep_pid = (int(x) for x in log.read_text().split("pids ")[1].split()[:2])
    time.sleep(0.2)
    assert not _alive(cc_pid) and not _alive(sleep_pid)


def test_module_names_follow_the_sources(tmp_path, fake):
    kernel, _ = fake
    other = tmp_path / "other.c"
    other.write_text(_C + "/* edited */\n")
    edited = build.Kernel(kernel.name, (other,), kernel.env, kernel.symbols, preload=())
    assert edited.key != kernel.key and edited.module_name != kernel.module_name
    assert sysconfig.get_paths()["include"]  # the stand-in compiler's headers
