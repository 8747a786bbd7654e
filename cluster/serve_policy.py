"""A kvmesh autoscaling policy called as Serve's controller calls it, on a clock the caller gives.

The policy goes through Serve's own wrapper (`_apply_autoscaling_config`: scaling factors,
min/max replicas, upscale/downscale/to-zero delays, the cold-start path from 0 replicas) with an
AutoscalingContext built from the caller's per-replica metrics, so the simulator and the unit
tests run exactly the decision code a cluster runs. Serve's delay logic reads `time.time()`; it
is pinned to the caller's time for the call.
"""

from __future__ import annotations

import contextlib

from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

DEPLOYMENT = DeploymentID(name="KVWorker", app_name="kvmesh")


@contextlib.contextmanager
def _serve_clock(now: float):
    import ray.serve.autoscaling_policy as serve_policy_module

    real = serve_policy_module.time

    class _Pinned:
        @staticmethod
        def time() -> float:
            return now

    serve_policy_module.time = _Pinned
    try:
        yield
    finally:
        serve_policy_module.time = real


class ServePolicy:
    def __init__(self, policy, config: AutoscalingConfig):
        self.config = config
        self.wrapped = _apply_autoscaling_config(policy)
        self.state: dict = {}

    def decide(self, now: float, current: int, target: int, total_requests: float,
               queued_requests: float = 0.0, metrics: dict[str, list[float]] | None = None) -> int:
        """The new target replica count. `current`: running replicas; `target`: the count last
        decided (replicas still starting count there, not in `current`); `metrics`: each custom
        metric's value per running replica, as Serve aggregated it over the window."""
        replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(current)]
        aggregated = {name: dict(zip(replicas, values)) for name, values in (metrics or {}).items()}
        ctx = AutoscalingContext(
            deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
            current_num_replicas=current, target_num_replicas=target, running_replicas=replicas,
            total_num_requests=total_requests, total_queued_requests=queued_requests,
            aggregated_metrics=aggregated, raw_metrics={},
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=self.state, last_scale_up_time=None, last_scale_down_time=None,
            current_time=now, config=self.config)
        with _serve_clock(now):
            desired, self.state = self.wrapped(ctx)
        return desired
