"""The calibrated scaling study: the offline workload, the calibration and the table."""

from kvmesh.router.sim.scaling import (calibrate, nano_vllm_workload, offline_makespan,
                                       scaled_cost, scaling_table)


def test_offline_workload_is_nano_vllms():
    workload = nano_vllm_workload()
    assert len(workload.requests) == 256
    assert sum(r.output_len for r in workload.requests) == 133_966


def test_calibration_matches_the_measured_time():
    speed, default = calibrate(measured_seconds=6.90)
    assert 0 < speed < 1 < 6.90 / default  # our engine is slower than the ideal model
    assert abs(offline_makespan(scaled_cost(speed), nano_vllm_workload()) - 6.90) / 6.90 < 0.01


def test_scaling_table_reports_efficiency_against_one_worker():
    rows = scaling_table(scaled_cost(0.7), ["multiturn"], ["kv_events", "round_robin"], [1, 2],
                         requests_per_worker=60, load=0.7, saturation_load=1.5, seed=0, progress=False)
    assert [(r["policy"], r["workers"]) for r in rows] == [
        ("kv_events", 1), ("kv_events", 2), ("round_robin", 1), ("round_robin", 2)]
    for r in rows:
        if r["workers"] == 1:
            assert r["efficiency"] == 1.0 and r["hit_rate_vs_1"] == 1.0
        assert r["throughput_tok_s"] > 0 and 0 <= r["hit_rate"] <= 1
