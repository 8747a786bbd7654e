"""tests/ray_start_lock.py (held by tests/conftest.py): under pytest-xdist (PYTEST_XDIST_TESTRUNUID
set) two worker processes never hold it at once, and a process that holds it can take it again (a fixture
that sets up another inside itself); without xdist it is no lock."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import ray_start_lock as lock

TESTS = Path(__file__).resolve().parents[1]

HOLDER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from ray_start_lock import ray_start_lock
with ray_start_lock():
    start = time.time()
    with ray_start_lock():  # taken again inside: no deadlock
        time.sleep(0.5)
    print(json.dumps([start, time.time()]))
"""


def test_two_workers_of_one_run_hold_it_one_after_the_other():
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": uuid.uuid4().hex}
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(TESTS)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    (a0, a1), (b0, b1) = sorted(json.loads(p.communicate(timeout=60)[0]) for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert a1 - a0 >= 0.5 and b1 - b0 >= 0.5
    assert b0 >= a1, "both workers held the lock at once"


def test_without_xdist_it_takes_no_lock_file(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    monkeypatch.setattr(lock.tempfile, "gettempdir", lambda: str(tmp_path))
    with lock.ray_start_lock(), lock.ray_start_lock():
        assert list(tmp_path.iterdir()) == []
    assert lock._held == 0
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "run1")  # with it: the run's file
    with lock.ray_start_lock():
        assert [p.name for p in tmp_path.iterdir()] == ["kvmesh-pytest-run1-ray-start.lock"]
