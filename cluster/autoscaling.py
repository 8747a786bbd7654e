"""kvmesh autoscaling policies for Ray Serve.

Each policy is a class that Serve builds with `policy_kwargs` and calls with an AutoscalingContext
about every 0.1 s; it returns (desired replicas, policy state). The decision is a pure function of
the context: the workers' custom metrics (`record_autoscaling_stats`, averaged by Serve over the
look-back window) and the request counts. Serve wraps the policy and applies min/max replicas and
the upscale/downscale delays (decisions must hold that long), so a policy never sleeps or counts
time itself; tests run metric sequences through that same wrapper.
"""

from __future__ import annotations

import math
from typing import Any

# Names of the custom metrics a worker reports (cluster/worker.py record_autoscaling_stats).
KV_FREE_RATIO = "kvmesh_kv_free_ratio"
TTFT_P90 = "kvmesh_ttft_p90_s"
ONGOING = "kvmesh_ongoing_requests"


def _metric_values(ctx, name: str) -> list[float]:
    metrics = ctx.aggregated_metrics or {}
    per_replica = metrics.get(name) or {}
    return [float(v) for v in per_replica.values() if v is not None and v == v]


def _clamp(n: float, ctx) -> int:
    lo = ctx.capacity_adjusted_min_replicas
    hi = ctx.capacity_adjusted_max_replicas
    return int(max(lo, min(hi, n)))


def _total_requests(ctx) -> float:
    return float(ctx.total_num_requests or 0.0)


def replicas_for_requests(total_requests: float, target_per_replica: float) -> int:
    """Fewest replicas that keep requests per replica at or under the target (0 when idle)."""
    return math.ceil(total_requests / target_per_replica - 1e-9) if total_requests > 0 else 0


class OngoingRequestsPolicy:
    """Replicas = ceil(requests in flight / target per replica), like Serve's default but with
    the kvmesh config's target and an explicit minimum."""

    def __init__(self, target_ongoing_requests: float = 8.0, **_unused: Any):
        if target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {target_ongoing_requests}")
        self.target = float(target_ongoing_requests)

    def __call__(self, ctx) -> tuple[int, dict]:
        desired = replicas_for_requests(_total_requests(ctx), self.target)
        return _clamp(desired, ctx), {}


class KVPressurePolicy:
    """Scale up by one while the mean free-KV fraction of the workers is under the threshold;
    scale down by one when the KV used by all workers would still leave twice the threshold free
    on one fewer replica and the requests in flight fit the request target."""

    def __init__(self, kv_free_threshold: float = 0.1, target_ongoing_requests: float = 8.0,
                 **_unused: Any):
        if not 0.0 <= kv_free_threshold <= 1.0:
            raise ValueError(f"kv_free_threshold must be in [0, 1], got {kv_free_threshold}")
        self.threshold = float(kv_free_threshold)
        self.target = float(target_ongoing_requests)

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.current_num_replicas
        free = _metric_values(ctx, KV_FREE_RATIO)
        if not free:  # no worker reported yet: hold
            return _clamp(current, ctx), {}
        mean_free = sum(free) / len(free)
        if mean_free < self.threshold:
            return _clamp(current + 1, ctx), {}
        if current > 1:
            used_after = (1.0 - mean_free) * current / (current - 1)
            fits = replicas_for_requests(_total_requests(ctx), self.target) <= current - 1
            if 1.0 - used_after >= 2 * self.threshold and fits:
                return _clamp(current - 1, ctx), {}
        return _clamp(current, ctx), {}


class TTFTSLOPolicy:
    """Scale up by one while the workers' p90 time to first token (over the window) exceeds the
    target; scale down by one while it is under half the target and the requests in flight fit
    on one fewer replica at the request target."""

    def __init__(self, ttft_p90_target_s: float = 1.0, target_ongoing_requests: float = 8.0,
                 **_unused: Any):
        if ttft_p90_target_s <= 0:
            raise ValueError(f"ttft_p90_target_s must be > 0, got {ttft_p90_target_s}")
        self.target_s = float(ttft_p90_target_s)
        self.target_requests = float(target_ongoing_requests)

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.current_num_replicas
        p90s = _metric_values(ctx, TTFT_P90)
        worst = max(p90s) if p90s else 0.0
        if worst > self.target_s:
            return _clamp(current + 1, ctx), {}
        fits = replicas_for_requests(_total_requests(ctx), self.target_requests) <= current - 1
        if current > 1 and worst < 0.5 * self.target_s and fits:
            return _clamp(current - 1, ctx), {}
        return _clamp(current, ctx), {}


POLICY_CLASSES = {
    "ongoing_requests": OngoingRequestsPolicy,
    "kv_pressure": KVPressurePolicy,
    "ttft_slo": TTFTSLOPolicy,
}


def policy_import_path(policy: str) -> str:
    """The import path Serve's AutoscalingPolicy takes for a kvmesh policy name."""
    return f"kvmesh.cluster.autoscaling:{POLICY_CLASSES[policy].__name__}"


def serve_autoscaling_config(autoscaling, initial_replicas: int) -> dict:
    """Serve's `autoscaling_config` dict for the config's autoscaling section."""
    kwargs = {"target_ongoing_requests": autoscaling.target_ongoing_requests,
              "kv_free_threshold": autoscaling.kv_free_threshold,
              "ttft_p90_target_s": autoscaling.ttft_p90_target_s}
    return {
        "min_replicas": autoscaling.min_replicas,
        "max_replicas": autoscaling.max_replicas,
        "initial_replicas": max(autoscaling.min_replicas, min(autoscaling.max_replicas, initial_replicas)),
        "upscale_delay_s": autoscaling.upscale_delay_s,
        "downscale_delay_s": autoscaling.downscale_delay_s,
        "look_back_period_s": autoscaling.window_s,
        # Deprecated in Serve 2.60 for env variables, but still honoured; its 10 s default would
        # exceed short windows (look_back_period_s must be longer).
        "metrics_interval_s": min(1.0, autoscaling.window_s / 2),
        "target_ongoing_requests": autoscaling.target_ongoing_requests,
        "policy": {"policy_function": policy_import_path(autoscaling.policy), "policy_kwargs": kwargs},
    }
