"""Code that runs in every Ray worker process of a kvmesh cluster before any actor starts:
Ray's `worker_process_setup_hook`, so the Serve controller, proxies and replicas all run it.

Ray Serve 2.60 has no settings for some of what a server must control (which address its internal
servers bind, limits on what its proxies read); the modules in PATCHES each adjust one such thing
and say why. Each is a module with an `apply()` that is safe to call once per process and reads
its settings from the environment (cluster/launcher.py `listener_env`); unset, each has the
default of its `server.*` field.

How the hook reaches the processes:
- a local `kvmesh serve` sets it in `ray.init`'s job runtime_env (cluster/launcher.py), which the
  Serve controller and, through it, the proxies and replicas inherit;
- a cluster started elsewhere (`ray start` / `ray up`, KubeRay, a Ray in the images) sets NODE_ENV
  in the environment of `ray start` on every node (deploy/*.yaml, the Helm chart, docker/). Ray's
  default worker (`ray._private.workers.default_worker`) runs the hook named by that variable in
  every worker process the raylet starts, whichever job or detached actor it is for, so Serve's
  controller and proxies get the patches even when `serve deploy`, KubeRay's RayService or an
  earlier job started them. The variable is the one a job runtime_env's
  `worker_process_setup_hook` becomes (Ray 2.60 `ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR`);
  tests/unit/test_deploy_configs.py fails if Ray renames it.
"""

from __future__ import annotations

import importlib

HOOK = "kvmesh.cluster.ray_patches.setup_worker"

# Ray's name for the hook a worker process runs at start (internal to Ray, hence the check above).
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"

# What the node definitions of a cluster started elsewhere put in `ray start`'s environment.
NODE_ENV = {SETUP_HOOK_ENV: HOOK}

# Modules with an apply(); applied in this order.
PATCHES: tuple[str, ...] = (
    "kvmesh.cluster.serve_bind_address",  # replica-internal gRPC and the gRPC proxy off [::]
    "kvmesh.cluster.serve_http_limits",   # header size and header-read time on Serve's HTTP proxy
    "kvmesh.cluster.serve_grpc_decode",   # malformed request bytes -> INVALID_ARGUMENT
    "kvmesh.cluster.serve_grpc_cancel",   # a client's cancel reaches the ingress call
    "kvmesh.cluster.stream_idle_timeout",  # a streaming HTTP client that reads nothing is cut
)

_applied = False


def setup_worker() -> None:
    global _applied
    if _applied:  # the node's variable and a job's runtime_env may both name the hook
        return
    _applied = True
    for name in PATCHES:
        importlib.import_module(name).apply()
