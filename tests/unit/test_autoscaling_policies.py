"""kvmesh autoscaling policies, run on metric sequences through the same wrapper Serve's controller
applies (min/max replicas, upscale/downscale delays measured in wall-clock seconds)."""

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from kvmesh.cluster.autoscaling import (KV_FREE_RATIO, TTFT_P90, KVPressurePolicy,
                                        OngoingRequestsPolicy, TTFTSLOPolicy,
                                        replicas_for_requests, serve_autoscaling_config)
from kvmesh.serve_config import AutoscalingSection

DEPLOYMENT = DeploymentID(name="KVWorker", app_name="kvmesh")


def _replicas(n):
    return [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(n)]


class Driver:
    """Feeds a policy one context per tick, the way Serve's controller does."""

    def __init__(self, policy, min_replicas=1, max_replicas=4, up_s=2.0, down_s=5.0, start=1):
        self.config = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                                        upscale_delay_s=up_s, downscale_delay_s=down_s)
        self.policy = _apply_autoscaling_config(policy)
        self.replicas = start
        self.state = {}

    def tick(self, t, requests=0.0, metrics=None):
        replicas = _replicas(self.replicas)
        aggregated = {name: {r: value for r in replicas} for name, value in (metrics or {}).items()}
        ctx = AutoscalingContext(
            deployment_id=DEPLOYMENT, deployment_name="KVWorker", app_name="kvmesh",
            current_num_replicas=self.replicas, target_num_replicas=self.replicas,
            running_replicas=replicas, total_num_requests=requests, total_queued_requests=0,
            aggregated_metrics=aggregated, raw_metrics={},
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=self.state, last_scale_up_time=None, last_scale_down_time=None,
            current_time=t, config=self.config)
        # Serve's delay logic reads time.time(); pin it to the tick's time.
        import ray.serve.autoscaling_policy as ap
        real = ap.time.time
        ap.time.time = lambda: t
        try:
            self.replicas, self.state = self.policy(ctx)
        finally:
            ap.time.time = real
        return self.replicas

    def run(self, samples, dt=0.5, t0=1000.0):
        """samples: list of (requests, metrics) per tick; returns the replica count after each."""
        return [self.tick(t0 + i * dt, req, m) for i, (req, m) in enumerate(samples)]


def test_replicas_for_requests_rounds_up_and_is_zero_when_idle():
    assert replicas_for_requests(0, 8) == 0
    assert replicas_for_requests(8, 8) == 1
    assert replicas_for_requests(9, 8) == 2
    assert replicas_for_requests(16, 8) == 2


def test_ongoing_requests_scales_up_after_the_upscale_delay_and_down_after_the_downscale_delay():
    d = Driver(OngoingRequestsPolicy(target_ongoing_requests=2), up_s=2.0, down_s=3.0)
    busy = [(6.0, None)] * 6  # 6 in flight at 2 per replica -> 3 replicas, after 2 s
    assert d.run(busy) == [1, 1, 1, 1, 3, 3]
    idle = [(0.0, None)] * 8  # idle -> min_replicas 1, after 3 s
    assert d.run(idle, t0=2000.0) == [3, 3, 3, 3, 3, 3, 1, 1]


def test_ongoing_requests_respects_max_replicas():
    d = Driver(OngoingRequestsPolicy(target_ongoing_requests=1), max_replicas=3, up_s=0.0)
    assert d.run([(50.0, None)]) == [3]


def test_a_short_burst_shorter_than_the_upscale_delay_does_not_scale():
    d = Driver(OngoingRequestsPolicy(target_ongoing_requests=2), up_s=2.0)
    seq = [(6.0, None)] * 3 + [(1.0, None)] * 6
    assert d.run(seq) == [1] * 9


def test_kv_pressure_scales_up_one_at_a_time_while_free_blocks_stay_under_the_threshold():
    d = Driver(KVPressurePolicy(kv_free_threshold=0.1, target_ongoing_requests=8), up_s=1.0, down_s=2.0)
    tight = [(4.0, {KV_FREE_RATIO: 0.05})] * 8
    assert d.run(tight) == [1, 1, 2, 2, 2, 3, 3, 3]


def test_kv_pressure_scales_down_when_the_kv_in_use_fits_on_fewer_replicas():
    d = Driver(KVPressurePolicy(kv_free_threshold=0.1, target_ongoing_requests=8), up_s=1.0,
               down_s=2.0, start=3)
    # 40% used on each of 3 -> 60% on 2 -> 40% free >= 2 * 10%: down to 2, then 90% used on 1: hold
    samples = [(2.0, {KV_FREE_RATIO: 0.6})] * 6
    assert d.run(samples) == [3, 3, 3, 3, 2, 2]
    assert d.run([(2.0, {KV_FREE_RATIO: 0.55})] * 8, t0=3000.0) == [2] * 8


def test_kv_pressure_holds_without_metrics():
    d = Driver(KVPressurePolicy(), up_s=0.0, down_s=0.0, start=2)
    assert d.run([(0.0, None)] * 3) == [2, 2, 2]


def test_ttft_slo_scales_up_while_p90_exceeds_the_target_and_down_when_well_under_and_idle():
    d = Driver(TTFTSLOPolicy(ttft_p90_target_s=1.0, target_ongoing_requests=4), up_s=1.0, down_s=2.0)
    slow = [(4.0, {TTFT_P90: 2.5})] * 6
    assert d.run(slow) == [1, 1, 2, 2, 2, 3]
    ok = [(4.0, {TTFT_P90: 0.8})] * 6  # inside the SLO but not under half of it: hold
    assert d.run(ok, t0=2000.0) == [3] * 6
    idle = [(0.0, {TTFT_P90: 0.0})] * 12
    assert d.run(idle, t0=3000.0) == [3, 3, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1]


def test_ttft_slo_does_not_scale_down_while_requests_need_the_replicas():
    d = Driver(TTFTSLOPolicy(ttft_p90_target_s=1.0, target_ongoing_requests=4), down_s=0.0, start=2)
    assert d.run([(8.0, {TTFT_P90: 0.1})] * 3) == [2, 2, 2]


def test_policies_reject_bad_parameters():
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        OngoingRequestsPolicy(target_ongoing_requests=0)
    with pytest.raises(ValueError, match="kv_free_threshold"):
        KVPressurePolicy(kv_free_threshold=1.5)
    with pytest.raises(ValueError, match="ttft_p90_target_s"):
        TTFTSLOPolicy(ttft_p90_target_s=0)


def test_serve_autoscaling_config_carries_the_kvmesh_section():
    section = AutoscalingSection(enabled=True, policy="kv_pressure", min_replicas=1, max_replicas=3,
                                 upscale_delay_s=2, downscale_delay_s=7, window_s=10)
    cfg = AutoscalingConfig(**serve_autoscaling_config(section, initial_replicas=5))
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas) == (1, 3, 3)
    assert (cfg.upscale_delay_s, cfg.downscale_delay_s, cfg.look_back_period_s) == (2, 7, 10)
    assert cfg.policy.policy_function == "kvmesh.cluster.autoscaling:KVPressurePolicy"
    assert cfg.policy.policy_kwargs["kv_free_threshold"] == 0.1
