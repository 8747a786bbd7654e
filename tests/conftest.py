import os
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

from ray_start_lock import cpu_slot, ray_start_lock

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


# Under pytest-xdist, Ray start-ups wait for each other (tests/ray_start_lock.py): each fixture of
# tests/integration (where the modules start their clusters) and the whole of each test marked
# `starts_ray` (whose body starts Ray) run holding the lock.

INTEGRATION = Path(__file__).resolve().parent / "integration"


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    code = getattr(fixturedef.func, "__code__", None)
    ours = code is not None and Path(code.co_filename).resolve().parent == INTEGRATION
    with ray_start_lock() if ours else nullcontext():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # a test marked `alone` runs while the other xdist worker runs no test (its setup and teardown
    # included); every other test holds the slot shared (tests/ray_start_lock.py)
    with cpu_slot(alone=item.get_closest_marker("alone") is not None):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with ray_start_lock() if item.get_closest_marker("starts_ray") is not None else nullcontext():
        yield
