import fcntl
import os
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Keep every test's model cache inside the session's cache (converted once per machine).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_report_header(config):
    return [f"kvmesh tests: repo {REPO}, python {sys.version.split()[0]}"]


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"../shared is not present beside the repository ({SHARED})")
    return SHARED


# Two pytest workers (pytest-xdist, as the README's test command runs) must not start Ray nodes at
# the same time: on a 2-core machine a raylet starting beside another cluster's start-up missed
# Ray's 30 s registration deadline ("The current node timed out during startup"). So each fixture
# of tests/integration (where the modules start their clusters) and the whole of each test marked
# `starts_ray` (whose body starts Ray) run holding one lock file shared by this run's workers.
# Without xdist there is one process and no lock.

_held = 0  # this process's depth inside the lock (a fixture may set up another inside itself)


@contextmanager
def ray_start_lock():
    global _held
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None or _held:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    with open(Path(tempfile.gettempdir()) / f"kvmesh-pytest-{run}-ray-start.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _held += 1
        try:
            yield
        finally:
            _held -= 1
            fcntl.flock(f, fcntl.LOCK_UN)


INTEGRATION = Path(__file__).resolve().parent / "integration"


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    code = getattr(fixturedef.func, "__code__", None)
    ours = code is not None and Path(code.co_filename).resolve().parent == INTEGRATION
    with ray_start_lock() if ours else nullcontext():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with ray_start_lock() if item.get_closest_marker("starts_ray") is not None else nullcontext():
        yield
