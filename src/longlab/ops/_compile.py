"""The compiler child of :mod:`longlab.ops.build` (``python .../longlab/ops/_compile.py SPEC_JSON``: run as a
script, so it does not import the longlab package).

It leads its own process group (the builder starts it with ``start_new_session``) and compiles with
``torch.utils.cpp_extension.load`` (or runs the spec's ``command``, an argv, for a kernel built by a plain
command) into its private directory (torch's own build lock there is never
shared, so it cannot be left behind for anyone else). A watchdog thread kills the whole group (ninja,
the compiler) as soon as the parent process dies, so a killed ``longlab`` run leaves no compiler behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # the builder died (we were re-parented): take the group down
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(0.5)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    parent = int(spec.get("parent") or os.getppid())
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if spec.get("command"):
        import subprocess

        return subprocess.run(spec["command"], stdin=subprocess.DEVNULL).returncode
    from torch.utils.cpp_extension import load

    load(spec["name"], spec["sources"], extra_cflags=spec["cflags"], build_directory=spec["workdir"],
         verbose=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
