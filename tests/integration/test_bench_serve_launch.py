"""`kvmesh bench serve --launch ... --cpu-split` end to end on a one-replica CPU cluster: the run
completes every request and splits the cluster's CPU time by process role."""

import json

import pytest

from kvmesh.bench import serve

pytestmark = pytest.mark.slow


def test_launch_runs_the_trace_and_splits_cpu_time_by_process(tmp_path, capsys):
    out = tmp_path / "result.json"
    code = serve.main(["--launch", "--replicas 1 --device cpu --model random:tiny-llama", "--policies", "kv_events",
                       "--concurrency", "4", "--num-requests", "12", "--num-tenants", "2", "--system-tokens", "64",
                       "--suffix-tokens", "8", "16", "--output-tokens", "8", "16", "--cpu-split", "--json", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["results"]["kv_events"]
    assert row["ok"] == 12 and row["chunks"] >= 12 and row["prefix_hit_rate"] > 0
    split = row["cpu_split"]
    assert {"proxy", "ingress", "worker actor", "engine"} <= set(split), split
    assert all(v["cpu_s"] > 0 and v["ms_per_request"] > 0 for k, v in split.items()
               if k in ("proxy", "ingress", "worker actor", "engine"))
    assert "CPU per request / per streamed chunk" in capsys.readouterr().out
