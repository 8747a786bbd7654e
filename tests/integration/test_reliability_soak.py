"""`kvmesh bench soak` for 60 s in CI: mixed streaming / non-streaming / aborted requests against a
2-replica CPU cluster it launches, memory of the ingress, workers and KV event hub sampled every
second. Nothing may be lost, and no process may grow by more than 50 MB after the warm-up."""

import json
import subprocess
import sys

import pytest

from kvmesh.cluster.local import loopback_ray_env

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]

DURATION_S = 60


def test_a_60_s_soak_loses_nothing_and_memory_stays_flat(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "soak", "--launch",
         "--replicas 2 --device cpu --model random:tiny-llama", "--duration-s", str(DURATION_S),
         "--concurrency", "8", "--sample-every-s", "1", "--max-growth-mb", "50",
         "--json", str(out)],
        capture_output=True, text=True, timeout=DURATION_S + 240, env=loopback_ray_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["lost"] == 0 and r["problems"] == []
    assert r["requests"] >= 200, r["requests"]
    kinds = r["by_kind_result"]
    assert kinds.get("abort:aborted", 0) > 0 and kinds.get("stream:ok", 0) > 0 and kinds.get("whole:ok", 0) > 0
    roles = {k.split("[")[0] for k in r["growth_mb"]}
    assert {"Ingress", "KVWorker", "KVEventHub", "ingress_rss_mb"} <= roles, roles
    assert all(g is not None and g < 50 for g in r["growth_mb"].values()), r["growth_mb"]
    assert 0 < r["router_index_peak_blocks"] <= r["kv_pool_blocks"]
    assert "PASS" in proc.stdout
