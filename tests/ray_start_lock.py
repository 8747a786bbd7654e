"""The locks that keep two pytest workers out of each other's way on a 2-core machine.

Under pytest-xdist (two workers: `-n 2 --dist loadfile`, as the README says how to run them):
- `ray_start_lock`: a raylet starting beside another cluster's start-up missed Ray's 30 s
  registration deadline ("The current node timed out during startup"). tests/conftest.py holds it
  around what starts clusters.
- `cpu_slot`: a test that measures how the cluster shares work under its own load (a throttled
  replica must get under half the requests) failed once when the other worker's test loaded the
  cores. Every test holds the run's slot shared; a test marked `alone` holds it exclusively, so it
  starts once the other worker's current test has ended and no other test starts until it is done
  (a turnstile keeps the other worker's next tests from overtaking it). The other worker's idle
  clusters stay up meanwhile.

Both are file locks shared by the workers of one run (PYTEST_XDIST_TESTRUNUID); without xdist there
is one process and no lock. Order: the slot (around a whole test) before the Ray start lock (around
fixtures and bodies inside it), in every worker.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

_held = 0  # this process's depth inside the lock (a fixture may set up another inside itself)


@contextmanager
def _file_lock(path: Path, mode: int = fcntl.LOCK_EX):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_file(name: str) -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return None if run is None else Path(tempfile.gettempdir()) / f"kvmesh-pytest-{run}-{name}.lock"


@contextmanager
def cpu_slot(alone: bool):
    slot, turnstile = _run_file("cpu-slot"), _run_file("cpu-turnstile")
    if slot is None:
        yield
    elif alone:
        with _file_lock(turnstile), _file_lock(slot):
            yield
    else:
        with _file_lock(turnstile):  # passes at once unless an `alone` test waits or runs
            pass
        with _file_lock(slot, fcntl.LOCK_SH):
            yield


@contextmanager
def ray_start_lock():
    global _held
    path = _run_file("ray-start")
    with _file_lock(path) if path is not None and not _held else nullcontext():
        _held += 1
        try:
            yield
        finally:
            _held -= 1
