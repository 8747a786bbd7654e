"""Run a Triton kernel script on the CPU under Triton's interpreter: TRITON_INTERPRET=1 is read when
a kernel is defined, so the script runs in a fresh child process from the repository root. The
script prints one JSON object as its last line; that object is returned."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: float = 600) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
