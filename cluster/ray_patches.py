"""Code that runs in every Ray worker process of a local `kvmesh serve` before any actor starts:
Ray's `worker_process_setup_hook` (set in `ray.init`'s job runtime_env by cluster/launcher.py, so the
Serve controller, proxies and replicas all run it).

Ray Serve 2.60 has no settings for some of what a server must control (which address its internal
servers bind, limits on what its proxies read); the modules in PATCHES each adjust one such thing
and say why. Each is a module with an `apply()` that is safe to call once per process and reads
its settings from the environment the launcher set (cluster/launcher.py `listener_env`).
"""

from __future__ import annotations

import importlib

HOOK = "kvmesh.cluster.ray_patches.setup_worker"

# Modules with an apply(); applied in this order.
PATCHES: tuple[str, ...] = (
    "kvmesh.cluster.serve_bind_address",  # replica-internal gRPC and the gRPC proxy off [::]
    "kvmesh.cluster.serve_http_limits",   # header size and header-read time on Serve's HTTP proxy
    "kvmesh.cluster.serve_grpc_decode",   # malformed request bytes -> INVALID_ARGUMENT
    "kvmesh.cluster.serve_grpc_cancel",   # a client's cancel reaches the ingress call
    "kvmesh.cluster.stream_idle_timeout",  # a streaming HTTP client that reads nothing is cut
)


def setup_worker() -> None:
    for name in PATCHES:
        importlib.import_module(name).apply()
