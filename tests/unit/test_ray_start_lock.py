"""tests/ray_start_lock.py (held by tests/conftest.py): under pytest-xdist (PYTEST_XDIST_TESTRUNUID
set) two worker processes never hold it at once, and a process that holds it can take it again (a fixture
that sets up another inside itself); without xdist it is no lock."""

import json
import os
import subprocess
import sys
import time
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


SLOT_USER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from ray_start_lock import cpu_slot
alone, at, hold = sys.argv[2] == "alone", float(sys.argv[3]), float(sys.argv[4])
time.sleep(max(0.0, at - time.time()))
asked = time.time()
with cpu_slot(alone=alone):
    start = time.time()
    time.sleep(hold)
    end = time.time()  # inside: after the release the next holder may start at once
print(json.dumps([asked, start, end]))
"""


def _slot_users(specs):
    """Processes of one run taking the cpu slot: (alone or shared, when it asks in seconds from a
    common start 2 s ahead (past the processes' start-up), how long it holds it) each."""
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": uuid.uuid4().hex}
    t0 = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", SLOT_USER, str(TESTS), kind, str(t0 + delay), str(hold)],
                              env=env, stdout=subprocess.PIPE, text=True) for kind, delay, hold in specs]
    spans = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return spans


def test_shared_holders_run_together_and_an_alone_one_waits_for_them_and_blocks_new_ones():
    # a shared holder from t=0 to 2; an `alone` one asks at 0.7; a shared one asks at 1.4
    shared, alone, late = _slot_users([("shared", 0.0, 2.0), ("alone", 0.7, 1.0), ("shared", 1.4, 0.2)])
    assert alone[0] < shared[2] and late[0] < alone[1]  # each asked while the one before held it
    assert alone[1] >= shared[2], "the alone test started while another test ran"
    assert late[1] >= alone[2], "a test started while the alone test waited or ran"
    a, b = _slot_users([("shared", 0.0, 1.0), ("shared", 0.2, 1.0)])
    assert b[1] < a[2], "two shared holders did not run at the same time"


def test_without_xdist_the_slot_takes_no_lock_file(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    monkeypatch.setattr(lock.tempfile, "gettempdir", lambda: str(tmp_path))
    with lock.cpu_slot(alone=True), lock.cpu_slot(alone=False):
        assert list(tmp_path.iterdir()) == []
