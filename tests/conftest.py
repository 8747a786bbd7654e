import os
import sys
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
