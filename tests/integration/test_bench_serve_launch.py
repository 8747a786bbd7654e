"""`kvmesh bench serve --launch ... --cpu-split` end to end on a one-replica CPU cluster: the run
completes every request and splits the cluster's CPU time by process role."""

import json

import pytest

from kvmesh.bench import serve

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]


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


def test_a_rate_sweep_through_the_direct_port_gives_a_row_per_rate_samples_and_a_plot(tmp_path, capsys):
    from kvmesh.cluster.local import free_port

    port = free_port()
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code = serve.main(["--launch", "--replicas 1 --device cpu --model random:tiny-llama", "--policies", "kv_events",
                       "--rate", "4", "8", "--num-requests", "8", "--num-tenants", "2", "--system-tokens", "64",
                       "--suffix-tokens", "8", "16", "--output-tokens", "4", "8",
                       "--direct-http-port", str(port), "--sample-s", "0.2",
                       "--plot", str(png), "--json", str(out)])
    assert code == 0
    assert f"[kv_events] serving at http://127.0.0.1:{port}\n" in capsys.readouterr().err  # the requests' URL
    rows = json.loads(out.read_text())["results"]
    assert sorted(rows) == ["kv_events @ 4/s", "kv_events @ 8/s"]
    assert all(r["ok"] == 8 and r["policy"] == "kv_events" for r in rows.values())
    assert [rows[k]["rate"] for k in sorted(rows)] == [4.0, 8.0]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    for r in rows.values():  # the workers were sampled during each run
        assert r["samples"] and set(r["sampled"]) == set(r["workers"])
        assert all(w["step_ms_p50"] > 0 for w in r["sampled"].values())
