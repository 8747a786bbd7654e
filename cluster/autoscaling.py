"""kvmesh autoscaling policies for Ray Serve.

Each policy is a class that Serve builds with `policy_kwargs` and calls with an AutoscalingContext
about every 0.1 s; it returns (desired replicas, policy state). The decision is a pure function of
the context: the workers' custom metrics (`record_autoscaling_stats`, aggregated by Serve over the
look-back window) and the request counts. Serve wraps the policy (`_apply_autoscaling_config`):
it applies the upscaling/downscaling factors, min/max replicas and the upscale/downscale delays
(decisions must hold that long; 1 -> 0 waits downscale_to_zero_delay_s), and starts a replica at
once when requests arrive with none running (its cold-start path, which never calls the policy).
So a policy never sleeps or counts time itself; tests run metric sequences through that wrapper.

Every policy asks for the replica count it needs in one step (proportional to how far its signal
is from the target), not one more at a time: a burst is met after one upscale delay.
"""

from __future__ import annotations

import math
from typing import Any

# Names of the custom metrics a worker reports (cluster/worker.py record_autoscaling_stats).
KV_FREE_RATIO = "kvmesh_kv_free_ratio"
TTFT_P90 = "kvmesh_ttft_p90_s"  # end to end, from the ingress's arrival stamp (slo_window.py)
ITL_P90 = "kvmesh_itl_p90_s"
ONGOING = "kvmesh_ongoing_requests"
WAITING = "kvmesh_waiting_requests"  # in the engine, not yet admitted (no KV blocks yet)
RUNNING = "kvmesh_running_requests"  # in the engine's batch

# An SLO policy gives replicas back only while its figure is under this fraction of the target, so
# that a fleet just inside the SLO does not shrink into a violation.
SLO_DOWNSCALE_MARGIN = 0.5


def _metric_values(ctx, name: str) -> list[float]:
    metrics = ctx.aggregated_metrics or {}
    per_replica = metrics.get(name) or {}
    return [float(v) for v in per_replica.values() if v is not None and v == v]


def _clamp(n: float, ctx) -> int:
    lo = ctx.capacity_adjusted_min_replicas
    hi = ctx.capacity_adjusted_max_replicas
    return int(max(lo, min(hi, n)))


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)


def replicas_for_requests(total_requests: float, target_per_replica: float) -> int:
    """Fewest replicas that keep requests per replica at or under the target (0 when idle)."""
    return _ceil(total_requests / target_per_replica) if total_requests > 0 else 0


def requests_in_system(ctx) -> float:
    """Requests the deployment holds: running + waiting in the workers' engines (their reports)
    plus those queued at the ingress handles for a free replica slot, or Serve's own count of
    requests at replicas and handles when that is larger (a worker's report lags its last step)."""
    engine = sum(_metric_values(ctx, WAITING)) + sum(_metric_values(ctx, RUNNING))
    queued = float(ctx.total_queued_requests or 0.0)
    return max(engine + queued, float(ctx.total_num_requests or 0.0))


def _check_positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


class OngoingRequestsPolicy:
    """Replicas = ceil(requests in flight / target per replica) from Serve's request count alone,
    like Serve's default policy but with the kvmesh config's target."""

    def __init__(self, target_ongoing_requests: float = 8.0, **_unused: Any):
        self.target = _check_positive("target_ongoing_requests", target_ongoing_requests)

    def __call__(self, ctx) -> tuple[int, dict]:
        desired = replicas_for_requests(float(ctx.total_num_requests or 0.0), self.target)
        return _clamp(desired, ctx), {}


class QueuePolicy:
    """Replicas = ceil((running + waiting in the engines + queued at the ingress) / target per
    replica): the queue a replica would hold at the target, counted where the requests are."""

    def __init__(self, target_ongoing_requests: float = 8.0, **_unused: Any):
        self.target = _check_positive("target_ongoing_requests", target_ongoing_requests)

    def __call__(self, ctx) -> tuple[int, dict]:
        return _clamp(replicas_for_requests(requests_in_system(ctx), self.target), ctx), {}


class KVPressurePolicy:
    """Replicas for the KV the requests need at `kv_free_threshold` free: the workers' KV in use
    (in replicas' worth), scaled by requests in the system / requests running (waiting and queued
    requests need KV too, which a full pool cannot show), over (1 - threshold). Scale down only
    to a count that would leave twice the threshold free and keeps the requests per replica at
    the request target."""

    def __init__(self, kv_free_threshold: float = 0.1, target_ongoing_requests: float = 8.0,
                 **_unused: Any):
        if not 0.0 <= kv_free_threshold < 1.0:
            raise ValueError(f"kv_free_threshold must be in [0, 1), got {kv_free_threshold}")
        self.threshold = float(kv_free_threshold)
        self.target = _check_positive("target_ongoing_requests", target_ongoing_requests)

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.current_num_replicas
        free = _metric_values(ctx, KV_FREE_RATIO)
        in_system = requests_in_system(ctx)
        if not free:  # no worker reported yet: hold (or give back an idle deployment)
            return _clamp(current if in_system else 0, ctx), {}
        kv_needed = sum(1.0 - f for f in free) * self._demand_scale(ctx, in_system)
        up = _ceil(kv_needed / (1.0 - self.threshold))
        if up > current:
            return _clamp(up, ctx), {}
        down_free = 1.0 - 2 * self.threshold
        kv_floor = _ceil(kv_needed / down_free) if down_free > 0 else current
        down = max(kv_floor, replicas_for_requests(in_system, self.target))
        return _clamp(min(current, down), ctx), {}

    @staticmethod
    def _demand_scale(ctx, in_system: float) -> float:
        running = sum(_metric_values(ctx, RUNNING))
        return in_system / running if running > 0 and in_system > running else 1.0


class LatencySLOPolicy:
    """Scale on one latency figure the workers report against its target: over the target,
    replicas = ceil(current * worst replica's figure / target) in one step; under half the target,
    down to the replicas the requests in the system need at `target_ongoing_requests` (0 when
    idle); in between, hold. Subclasses name the metric and the target's keyword."""

    metric = ""
    target_name = ""

    def __init__(self, target_s: float, target_ongoing_requests: float):
        self.target_s = _check_positive(self.target_name, target_s)
        self.target_requests = _check_positive("target_ongoing_requests", target_ongoing_requests)

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.current_num_replicas
        worst = max(_metric_values(ctx, self.metric), default=0.0)
        if worst > self.target_s and current > 0:
            return _clamp(_ceil(current * worst / self.target_s), ctx), {}
        if worst < SLO_DOWNSCALE_MARGIN * self.target_s:
            needed = replicas_for_requests(requests_in_system(ctx), self.target_requests)
            return _clamp(min(current, needed), ctx), {}
        return _clamp(current, ctx), {}


class TTFTSLOPolicy(LatencySLOPolicy):
    """p90 time to first token, end to end: from the request's arrival at the ingress (so its wait
    there is inside), requests still without a first token counted with their age."""

    metric, target_name = TTFT_P90, "ttft_p90_target_s"

    def __init__(self, ttft_p90_target_s: float = 1.0, target_ongoing_requests: float = 8.0,
                 **_unused: Any):
        super().__init__(ttft_p90_target_s, target_ongoing_requests)


class ITLSLOPolicy(LatencySLOPolicy):
    """p90 inter-token latency: each finished request's mean time per output token after the
    first (it grows with the batch a replica decodes)."""

    metric, target_name = ITL_P90, "itl_p90_target_s"

    def __init__(self, itl_p90_target_s: float = 0.1, target_ongoing_requests: float = 8.0,
                 **_unused: Any):
        super().__init__(itl_p90_target_s, target_ongoing_requests)


POLICY_CLASSES = {
    "ongoing_requests": OngoingRequestsPolicy,
    "queue": QueuePolicy,
    "kv_pressure": KVPressurePolicy,
    "ttft_slo": TTFTSLOPolicy,
    "itl_slo": ITLSLOPolicy,
}


def policy_import_path(policy: str) -> str:
    """The import path Serve's AutoscalingPolicy takes for a kvmesh policy name."""
    return f"kvmesh.cluster.autoscaling:{POLICY_CLASSES[policy].__name__}"


def policy_kwargs(autoscaling) -> dict:
    """The keyword arguments every kvmesh policy is built with (each takes the ones it reads)."""
    return {"target_ongoing_requests": autoscaling.target_ongoing_requests,
            "kv_free_threshold": autoscaling.kv_free_threshold,
            "ttft_p90_target_s": autoscaling.ttft_p90_target_s,
            "itl_p90_target_s": autoscaling.itl_p90_target_s}


def build_policy(autoscaling):
    """The config's policy object, as Serve builds it (for the simulator)."""
    return POLICY_CLASSES[autoscaling.policy](**policy_kwargs(autoscaling))


def serve_autoscaling_config(autoscaling, initial_replicas: int) -> dict:
    """Serve's `autoscaling_config` dict for the config's autoscaling section."""
    return {
        "min_replicas": autoscaling.min_replicas,
        "max_replicas": autoscaling.max_replicas,
        "initial_replicas": max(autoscaling.min_replicas, min(autoscaling.max_replicas, initial_replicas)),
        "upscale_delay_s": autoscaling.upscale_delay_s,
        "downscale_delay_s": autoscaling.downscale_delay_s,
        "downscale_to_zero_delay_s": autoscaling.downscale_to_zero_delay_s,
        "upscaling_factor": autoscaling.upscaling_factor,
        "downscaling_factor": autoscaling.downscaling_factor,
        "aggregation_function": autoscaling.aggregation_function,
        "look_back_period_s": autoscaling.window_s,
        # Deprecated in Serve 2.60 for env variables, but still honoured; its 10 s default would
        # exceed short windows (look_back_period_s must be longer).
        "metrics_interval_s": min(1.0, autoscaling.window_s / 2),
        "target_ongoing_requests": autoscaling.target_ongoing_requests,
        "policy": {"policy_function": policy_import_path(autoscaling.policy),
                   "policy_kwargs": policy_kwargs(autoscaling)},
    }
