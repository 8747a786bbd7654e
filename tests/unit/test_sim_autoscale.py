"""The autoscaling simulator: the bursty profile's rate, a fixed fleet billed for all its time,
and an autoscaled fleet that starts from zero replicas, serves every request and bills less."""

import numpy as np
import pytest

from kvmesh.cluster.autoscale_sim import BurstProfile, run_from_options
from kvmesh.router.sim.cluster import SimConfig
from kvmesh.router.sim.workloads import make_workload


def test_the_profile_is_quiet_then_ramps_to_the_peak_and_back():
    p = BurstProfile(period_s=300, burst_s=60, base_load=0.2, ramp_s=60)
    rate = p.rate_shape(np.array([0.0, 119.0, 150.0, 180.0, 239.0, 270.0]))
    assert np.allclose(rate, [0.2, 0.2, 0.6, 1.0, 1.0, 0.6])
    step = BurstProfile(period_s=300, burst_s=60, base_load=0.2)
    assert np.allclose(step.rate_shape(np.array([239.0, 240.0, 299.0])), [0.2, 1.0, 1.0])


def test_arrivals_follow_the_profile():
    workload = make_workload("random", 4000, output_tokens=(16, 32), prompt_tokens=(64, 128))
    BurstProfile(period_s=100, burst_s=20, base_load=0.25).assign(workload, peak_rate=100.0)
    arrivals = np.array([r.arrival for r in workload.requests])
    first = arrivals[arrivals < 100]
    quiet, burst = np.sum(first < 80), np.sum(first >= 80)  # expected 80 x 25 = 2000 and 20 x 100
    assert abs(quiet - 2000) < 200 and abs(burst - 2000) < 200


def test_bad_profile_and_options_name_the_field():
    with pytest.raises(ValueError, match="burst_s"):
        BurstProfile(period_s=100, burst_s=100)
    workload = make_workload("random", 10)
    with pytest.raises(ValueError, match="unknown --autoscale-opt tick"):
        run_from_options(workload, "queue", SimConfig(num_workers=2), 0.5, None, {"tick": 1})


def test_an_autoscaled_fleet_from_zero_serves_every_request_with_fewer_replica_hours():
    workload = make_workload("random", 3000, output_tokens=(16, 64), prompt_tokens=(64, 256))
    report = run_from_options(workload, "queue", SimConfig(num_workers=4), None, 200.0, {
        "period_s": 60, "burst_s": 10, "base_load": 0.1, "startup_s": 2, "upscale_delay_s": 0,
        "downscale_delay_s": 5, "window_s": 5, "target_ongoing_requests": 8})
    fixed, scaled = report["fixed"], report["autoscaled"]
    assert fixed["requests"] == scaled["requests"] == 3000
    assert fixed["replica_hours"] == pytest.approx(4 * fixed["duration_s"] / 3600)
    assert fixed["peak_replicas"] == 4 and 1 <= scaled["peak_replicas"] <= 4
    assert scaled["replica_hours"] < fixed["replica_hours"]
