"""The kvmesh Serve application: `kvmesh.cluster.app:build_app`, called by Serve (`serve deploy`,
`serve run`, KubeRay) and by `kvmesh serve` with `args` = the serving config as a dict.

Two deployments: KVWorker (one replica per GPU, routed by the KV-aware request router, optionally
autoscaled by a kvmesh policy) and Ingress (OpenAI HTTP + gRPC), which holds the workers' handle.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvmesh.cluster.autoscaling import serve_autoscaling_config
from kvmesh.cluster.ingress import Ingress
from kvmesh.cluster.grpc_health import servicer_functions
from kvmesh.cluster.worker import KVWorker
from kvmesh.serve_config import ServeConfig, parse_config

WORKER_DEPLOYMENT = "KVWorker"
INGRESS_DEPLOYMENT = "Ingress"
GRPC_SERVICER_FUNCTIONS = servicer_functions(reflection=True)
ROUTER_CLASS = "kvmesh.cluster.request_router:KVAwareRequestRouter"
# How often a stopping replica checks that its requests are done (Serve's default 2 s; a drain
# always waits one period, so an idle replica took 2 s to stop). The drain's bound is unchanged:
# graceful_shutdown_timeout_s.
DRAIN_POLL_S = 0.25


def worker_options(cfg: ServeConfig) -> dict:
    r = cfg.replicas
    actor = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus}
    if r.resources:
        actor["resources"] = dict(r.resources)
    options = {
        "name": WORKER_DEPLOYMENT,
        "ray_actor_options": actor,
        "max_ongoing_requests": r.max_ongoing_requests,
        "max_queued_requests": r.max_queued_requests,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={
                "app_name": cfg.app_name, "policy": cfg.routing.policy,
                # No cap in the kvmesh router: Serve enforces max_ongoing_requests exactly (a full
                # replica rejects and the next rank is tried), while the router's loads lag a
                # report behind and would call an idle worker full.
                "block_size": cfg.engine.block_size, "cap": None,
                "temperature": cfg.routing.temperature,
                "policy_options": dict(cfg.routing.policy_options),
                "poll_timeout_s": cfg.routing.event_poll_timeout_s}),
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 5.0,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }
    if cfg.autoscaling.enabled:
        options["autoscaling_config"] = serve_autoscaling_config(cfg.autoscaling, r.num_replicas)
    else:
        options["num_replicas"] = r.num_replicas
    return options


def ingress_options(cfg: ServeConfig) -> dict:
    return {
        "name": INGRESS_DEPLOYMENT,
        "num_replicas": cfg.routing.ingress_replicas,
        # Tokenizing and streaming are light: an ingress reserves no CPU, so it never waits
        # for one behind the workers.
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 100_000,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }


def build_app(args: dict | None = None):
    """The Serve application for a serving config dict (see kvmesh/serve_config.py)."""
    cfg = parse_config(args)
    data = cfg.to_dict()
    worker = serve.deployment(KVWorker).options(**worker_options(cfg)).bind(data)
    return serve.deployment(Ingress).options(**ingress_options(cfg)).bind(worker, data)


def serve_config_document(cfg: ServeConfig) -> dict:
    """The equivalent Serve config file (for `serve deploy`)."""
    doc = {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.server.host, "port": cfg.server.http_port,
                         "keep_alive_timeout_s": cfg.server.keep_alive_timeout_s},
        "applications": [{
            "name": cfg.app_name,
            "route_prefix": cfg.route_prefix,
            "import_path": "kvmesh.cluster.app:build_app",
            "args": cfg.to_dict(),
        }],
    }
    if cfg.server.grpc_port:  # 0 = no gRPC
        doc["grpc_options"] = {"port": cfg.server.grpc_port,
                               "grpc_servicer_functions": servicer_functions(cfg.server.grpc_reflection),
                               "enable_reflection": cfg.server.grpc_reflection}
    return doc
