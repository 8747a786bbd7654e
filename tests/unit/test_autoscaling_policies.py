"""kvmesh autoscaling policies, run on metric sequences through the same wrapper Serve's controller
applies (scaling factors, min/max replicas, upscale/downscale/to-zero delays measured in wall-clock
seconds, the cold-start path from 0 replicas)."""

import pytest
from ray.serve.config import AutoscalingConfig

from kvmesh.cluster.autoscaling import (ITL_P90, KV_FREE_RATIO, RUNNING, TTFT_P90, WAITING,
                                        ITLSLOPolicy, KVPressurePolicy, OngoingRequestsPolicy,
                                        QueuePolicy, TTFTSLOPolicy, build_policy,
                                        replicas_for_requests, serve_autoscaling_config)
from kvmesh.cluster.serve_policy import ServePolicy
from kvmesh.serve_config import AutoscalingSection


class Driver:
    """Feeds a policy one context per tick, the way Serve's controller does; a decision takes
    effect at once (every replica starts instantly)."""

    def __init__(self, policy, min_replicas=1, max_replicas=4, up_s=2.0, down_s=5.0, start=1,
                 **serve_knobs):
        self.serve = ServePolicy(policy, AutoscalingConfig(
            min_replicas=min_replicas, max_replicas=max_replicas, upscale_delay_s=up_s,
            downscale_delay_s=down_s, **serve_knobs))
        self.replicas = start

    def tick(self, t, requests=0.0, metrics=None, queued=0.0):
        per_replica = {name: [value] * self.replicas for name, value in (metrics or {}).items()}
        self.replicas = self.serve.decide(t, self.replicas, self.replicas, requests, queued, per_replica)
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


# The user's case (issue 16): 1 replica, 200 requests in flight (64 at the replica, the
# max_ongoing_requests, of which 48 run in the engine and 16 wait; 136 queued at the ingress),
# KV 99% full, TTFT 10x its target, ITL 5x. Every policy asks for what it needs in one step.
OVERLOAD = {KV_FREE_RATIO: 0.01, TTFT_P90: 10.0, ITL_P90: 0.5, RUNNING: 48.0, WAITING: 16.0}


@pytest.mark.parametrize("policy, expected", [
    (OngoingRequestsPolicy(target_ongoing_requests=8), 16),  # 200 / 8 = 25, capped at max 16
    (QueuePolicy(target_ongoing_requests=8), 16),
    # KV in use 0.99 x (200 in the system / 48 running) = 4.1 replicas' worth, at 10% free: 5
    (KVPressurePolicy(kv_free_threshold=0.1), 5),
    (TTFTSLOPolicy(ttft_p90_target_s=1.0), 10),  # 1 x 10 s / 1 s
    (ITLSLOPolicy(itl_p90_target_s=0.1), 5),  # 1 x 0.5 s / 0.1 s
])
def test_an_overloaded_replica_gets_the_replicas_it_needs_in_one_step(policy, expected):
    d = Driver(policy, max_replicas=16, up_s=1.0)
    d.tick(1000.0, 200.0, OVERLOAD, queued=136.0)
    assert d.replicas == 1  # the upscale delay holds
    assert d.tick(1001.0, 200.0, OVERLOAD, queued=136.0) == expected


def test_queue_counts_the_engines_reports_and_the_ingress_queue():
    # Serve's count lags at 4; the engine reports 10 running + 6 waiting, and 6 wait at the ingress.
    metrics = {RUNNING: 10.0, WAITING: 6.0}
    queue = Driver(QueuePolicy(target_ongoing_requests=8), up_s=0.0)
    assert queue.tick(1000.0, 4.0, metrics, queued=6.0) == 3  # (10 + 6 + 6) / 8
    ongoing = Driver(OngoingRequestsPolicy(target_ongoing_requests=8), up_s=0.0)
    assert ongoing.tick(1000.0, 4.0, metrics, queued=6.0) == 1


def test_queue_scales_down_in_one_step_when_the_queue_drains():
    d = Driver(QueuePolicy(target_ongoing_requests=4), up_s=0.0, down_s=1.0, start=4, max_replicas=8)
    assert d.run([(3.0, {RUNNING: 0.75, WAITING: 0.0})] * 4) == [4, 4, 1, 1]


def test_kv_pressure_sizes_the_fleet_for_the_kv_the_waiting_requests_need():
    d = Driver(KVPressurePolicy(kv_free_threshold=0.1), up_s=0.0, max_replicas=8, start=2)
    # 2 replicas 95% used with 10 running each, 60 in the system: 1.9 x 3 = 5.7 -> 5.7 / 0.9 -> 7
    assert d.tick(1000.0, 60.0, {KV_FREE_RATIO: 0.05, RUNNING: 10.0}) == 7


def test_kv_pressure_scales_down_when_the_kv_in_use_fits_on_fewer_replicas():
    d = Driver(KVPressurePolicy(kv_free_threshold=0.1, target_ongoing_requests=8), up_s=1.0,
               down_s=2.0, start=3)
    # 40% used on each of 3 = 1.2 replicas' worth; at 80% used at most: 2; then 0.9 on 2: hold
    samples = [(2.0, {KV_FREE_RATIO: 0.6})] * 6
    assert d.run(samples) == [3, 3, 3, 3, 2, 2]
    assert d.run([(2.0, {KV_FREE_RATIO: 0.55})] * 8, t0=3000.0) == [2] * 8


def test_kv_pressure_holds_without_metrics_while_requests_are_in_flight_and_gives_back_when_idle():
    d = Driver(KVPressurePolicy(), up_s=0.0, down_s=0.0, start=2)
    assert d.run([(3.0, None)] * 3) == [2, 2, 2]
    assert d.run([(0.0, None)] * 2, t0=2000.0) == [1, 1]


def test_ttft_slo_jumps_to_the_needed_replicas_and_holds_inside_the_slo():
    d = Driver(TTFTSLOPolicy(ttft_p90_target_s=1.0, target_ongoing_requests=4), up_s=1.0, down_s=2.0)
    slow = [(4.0, {TTFT_P90: 2.5})] * 3  # 1 x 2.5 / 1 -> 3, after 1 s
    assert d.run(slow) == [1, 1, 3]
    ok = [(4.0, {TTFT_P90: 0.8})] * 6  # inside the SLO but not under half of it: hold
    assert d.run(ok, t0=2000.0) == [3] * 6
    idle = [(0.0, {TTFT_P90: 0.0})] * 6  # idle: straight to min_replicas after the delay
    assert d.run(idle, t0=3000.0) == [3, 3, 3, 3, 1, 1]


def test_ttft_slo_does_not_scale_down_while_requests_need_the_replicas():
    d = Driver(TTFTSLOPolicy(ttft_p90_target_s=1.0, target_ongoing_requests=4), down_s=0.0, start=2)
    assert d.run([(8.0, {TTFT_P90: 0.1})] * 3) == [2, 2, 2]


def test_itl_slo_reads_the_inter_token_latency_not_the_ttft():
    d = Driver(ITLSLOPolicy(itl_p90_target_s=0.05), up_s=0.0, max_replicas=8)
    assert d.tick(1000.0, 4.0, {ITL_P90: 0.12, TTFT_P90: 0.01}) == 3  # ceil(0.12 / 0.05)
    d = Driver(ITLSLOPolicy(itl_p90_target_s=0.05), up_s=0.0, max_replicas=8)
    assert d.tick(1000.0, 4.0, {ITL_P90: 0.04, TTFT_P90: 9.0}) == 1


@pytest.mark.parametrize("policy", ["ongoing_requests", "queue", "kv_pressure", "ttft_slo", "itl_slo"])
def test_every_policy_scales_to_zero_after_the_to_zero_delay_and_back_at_the_first_request(policy):
    section = AutoscalingSection(enabled=True, policy=policy, min_replicas=0, max_replicas=4)
    d = Driver(build_policy(section), min_replicas=0, up_s=5.0, down_s=1.0, start=2,
               downscale_to_zero_delay_s=3.0)
    idle = {KV_FREE_RATIO: 1.0, TTFT_P90: 0.0, ITL_P90: 0.0, RUNNING: 0.0, WAITING: 0.0}
    # 2 -> 1 after downscale_delay_s (Serve goes to zero only from 1), 1 -> 0 after 3 s more
    assert d.run([(0.0, idle)] * 12) == [2, 2, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    # a request queued at the ingress with no replica: one at once (no upscale delay)
    assert d.tick(2000.0, 1.0, None, queued=1.0) == 1


def test_upscaling_factor_damps_a_scale_up():
    d = Driver(QueuePolicy(target_ongoing_requests=1), up_s=0.0, max_replicas=16, upscaling_factor=0.5)
    assert d.tick(1000.0, 9.0) == 5  # 1 + 0.5 x (9 - 1)


def test_policies_reject_bad_parameters():
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        OngoingRequestsPolicy(target_ongoing_requests=0)
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        QueuePolicy(target_ongoing_requests=-1)
    with pytest.raises(ValueError, match="kv_free_threshold"):
        KVPressurePolicy(kv_free_threshold=1.0)
    with pytest.raises(ValueError, match="ttft_p90_target_s"):
        TTFTSLOPolicy(ttft_p90_target_s=0)
    with pytest.raises(ValueError, match="itl_p90_target_s"):
        ITLSLOPolicy(itl_p90_target_s=0)


def test_serve_autoscaling_config_carries_the_kvmesh_section():
    section = AutoscalingSection(enabled=True, policy="kv_pressure", min_replicas=0, max_replicas=3,
                                 upscale_delay_s=2, downscale_delay_s=7, window_s=10,
                                 downscale_to_zero_delay_s=60, upscaling_factor=2.0,
                                 downscaling_factor=0.5, aggregation_function="max")
    cfg = AutoscalingConfig(**serve_autoscaling_config(section, initial_replicas=5))
    assert (cfg.min_replicas, cfg.max_replicas, cfg.initial_replicas) == (0, 3, 3)
    assert (cfg.upscale_delay_s, cfg.downscale_delay_s, cfg.look_back_period_s) == (2, 7, 10)
    assert cfg.downscale_to_zero_delay_s == 60
    assert (cfg.get_upscaling_factor(), cfg.get_downscaling_factor()) == (2.0, 0.5)
    assert cfg.aggregation_function == "max"
    assert cfg.policy.policy_function == "kvmesh.cluster.autoscaling:KVPressurePolicy"
    assert cfg.policy.policy_kwargs["kv_free_threshold"] == 0.1
    assert cfg.policy.policy_kwargs["itl_p90_target_s"] == 0.1
