"""The lock that keeps two pytest workers from starting Ray nodes at the same time.

Under pytest-xdist (two workers: `-n 2 --dist loadfile`, see the README) a raylet starting beside
another cluster's start-up on a 2-core machine missed Ray's 30 s registration deadline ("The current
node timed out during startup"). tests/conftest.py holds this lock around what starts clusters. It
is a file lock shared by the workers of one run (PYTEST_XDIST_TESTRUNUID); without xdist there is
one process and no lock.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

_held = 0  # this process's depth inside the lock (a fixture may set up another inside itself)


@contextmanager
def _file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def ray_start_lock():
    global _held
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    path = Path(tempfile.gettempdir()) / f"kvmesh-pytest-{run}-ray-start.lock"
    with _file_lock(path) if run is not None and not _held else nullcontext():
        _held += 1
        try:
            yield
        finally:
            _held -= 1
