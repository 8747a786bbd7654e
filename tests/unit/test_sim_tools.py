"""The routing tools ROUTING.md runs, at small sizes: `python -m kvmesh.router.sim.sweep` (policies
over loads, a row per load and policy, the plot) and `python -m kvmesh.router.sim.scale` (an index
filled through KV event batches, the decision latency and what the route picked); and PERF.md's
`python -m kvmesh.router.sim.scaling` (calibrated to a measured offline run, a row per size)."""

import json

import pytest

from kvmesh.router.sim import scale, sweep


def test_sweep_reports_each_policy_at_each_load_and_plots_them(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert sweep.main(["--workload", "tenants", "--workers", "4", "--requests", "200", "--loads", "0.5,0.9",
                       "--policies", "round_robin,kv_events", "--plot", str(png), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["workload"], result["workers"], result["requests"]) == ("tenants", 4, 200)
    assert [p["load"] for p in result["points"]] == [0.5, 0.9]
    for point in result["points"]:
        assert list(point["policies"]) == ["round_robin", "kv_events"]
        kv, rr = point["policies"]["kv_events"], point["policies"]["round_robin"]
        assert kv["hit_rate"] > rr["hit_rate"] and kv["ttft_p99_s"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


def test_scale_fills_the_index_by_events_and_times_full_rankings(capsys):
    assert scale.main(["--workers", "16", "--blocks", "300000", "--decisions", "300", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["workers"], r["index_blocks"], r["decisions"], r["prompt_blocks"]) == (16, 300_000, 300, 288)
    assert 0 < r["decision_p50_us"] <= r["decision_p99_us"] <= r["decision_max_us"]
    assert r["decision_cpu_p50_us"] > 0 and r["index_approx_bytes"] > 0
    assert r["routed_to_a_prefix_holder"] > 0.5  # kv_events sends most to a worker holding the prefix


def test_scaling_calibrates_to_the_measured_run_and_reports_each_size(tmp_path, capsys):
    from kvmesh.router.sim import scaling

    png = tmp_path / "scaling.png"
    assert scaling.main(["--measured-seconds", "6.90", "--workloads", "tenants", "--sizes", "1,2",
                         "--requests-per-worker", "60", "--plot", str(png), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    cal = r["calibration"]
    assert cal["measured_seconds"] == 6.90
    # the model's speed scaled so that nano-vllm's offline run takes the measured time in it
    scaled = scaling.offline_makespan(scaling.scaled_cost(cal["speed_factor"]), scaling.nano_vllm_workload())
    assert scaled == pytest.approx(6.90, rel=0.01) and cal["default_model_seconds"] > 0
    rows = {(row["policy"], row["workers"]): row for row in r["rows"]}
    assert set(rows) == {(p, n) for p in ("kv_events", "round_robin") for n in (1, 2)}
    for row in r["rows"]:
        assert (row["load"], row["saturation_load"]) == (0.7, 1.5)  # the defaults PERF.md states
        assert row["throughput_tok_s"] > 0 and row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert rows[("kv_events", 1)]["efficiency"] == 1.0 == rows[("kv_events", 1)]["hit_rate_vs_1"]
    assert png.read_bytes()[:4] == b"\x89PNG"
