"""`kvmesh serve`: start (or join) Ray, start Serve's HTTP and gRPC proxies, deploy the app, print
the endpoints, and wait until interrupted.

On a local Ray bound to 127.0.0.1 every Ray listener is kept on loopback
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must be set before Ray starts), and the object store is capped
so a laptop or CI box is not asked for a third of its memory. A local Ray also gets Ray's token
auth (cluster/ray_token.py) and the worker setup hook whose patches bind Serve's own servers to
that address and bound what its proxies read (cluster/ray_patches.py; their settings travel in
the environment Ray's processes inherit: listener_env). Joining a cluster (`--address`), the job's
runtime_env carries the same hook and settings to the Serve processes it starts.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager

from kvmesh.cluster.ray_token import enable_token_auth
from kvmesh.serve_config import ServeConfig

DEFAULT_OBJECT_STORE_BYTES = 512 * 1024 * 1024

# Ray Serve's throughput-optimized mode (its performance guide): user code and the request router on
# the replica's own event loop instead of a thread each, gRPC between the proxy and replicas, the GC
# frozen after start-up, no per-request log lines on stderr. It halves the ingress's and the worker
# actor's CPU per streamed token (docs/PERF.md "Serving cluster"). Its direct-ingress part (each
# ingress replica on its own port, for a load balancer in front) stays off: clients keep one port.
# Read by every Serve process when it starts, so it is set before Ray starts; a value already in the
# environment wins (RAY_SERVE_THROUGHPUT_OPTIMIZED=0 turns it off). Clusters started elsewhere (ray
# up, KubeRay) set the same variables in their node definitions (deploy/*.yaml, the Helm chart).
SERVE_FAST_PATH_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}

# Serve's default limit on messages between its proxy and a replica (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH).
SERVE_REPLICA_MESSAGE_BYTES = 4 * 1024 * 1024
REPLICA_MESSAGE_HEADROOM_BYTES = 1024 * 1024  # the request re-wrapped for the replica call
GRPC_MESSAGE_BYTES_CAP = 2**31 - 1  # gRPC takes its message limits as C ints


def replica_message_bytes(proxy_message_bytes: int) -> int:
    """Serve's proxy-to-replica message limit for a gRPC proxy limit of `proxy_message_bytes`: a
    request the proxy accepts must also fit, re-wrapped, between proxy and ingress replica. The
    Helm chart and the `ray up` configs (deploy/) set the same."""
    return min(GRPC_MESSAGE_BYTES_CAP,
               max(SERVE_REPLICA_MESSAGE_BYTES, proxy_message_bytes + REPLICA_MESSAGE_HEADROOM_BYTES))


def listener_env(cfg: ServeConfig) -> dict[str, str]:
    """What the worker setup hook's patches (cluster/ray_patches.py) and Serve read from the
    environment of a local Ray's processes: the listen address and the transport limits."""
    from kvmesh.cluster.serve_bind_address import HOST_ENV
    from kvmesh.cluster.serve_http_limits import HEADER_TIMEOUT_ENV, MAX_HEADER_BYTES_ENV
    from kvmesh.cluster.stream_idle_timeout import TIMEOUT_ENV as STREAM_IDLE_TIMEOUT_ENV

    server = cfg.server
    return {
        HOST_ENV: server.host,
        MAX_HEADER_BYTES_ENV: str(server.max_header_bytes),
        HEADER_TIMEOUT_ENV: str(server.header_timeout_s),
        STREAM_IDLE_TIMEOUT_ENV: str(server.stream_idle_timeout_s),
        # Serve's own setting of its gRPC proxy's largest message (both directions; answers are
        # small). A request that fits must also fit, re-wrapped, between proxy and ingress.
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(server.grpc_max_message_bytes),
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(
            replica_message_bytes(server.grpc_max_message_bytes)),
    }


def start_ray(cfg: ServeConfig, address: str | None, out=sys.stdout) -> str:
    """Join `address` or start a local Ray; returns the address others can join."""
    loopback = cfg.server.host in ("127.0.0.1", "localhost")
    if loopback and address is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if address is None:
        for name, value in SERVE_FAST_PATH_ENV.items():
            os.environ.setdefault(name, value)
        # Ray's processes inherit this environment (its workers run the setup hook).
        os.environ.update(listener_env(cfg))
        if (warning := enable_token_auth()) is not None:
            print(warning, file=out)
    import ray

    from kvmesh.cluster.ray_patches import HOOK

    if address is not None:
        # The Serve controller this job starts (when none runs yet), and through it the proxies and
        # replicas, inherit the job's runtime_env: the hook and this config's settings. A
        # controller already running keeps what its nodes' environment gives it (NODE_ENV in the
        # node definitions of deploy/, the Helm chart and the images: cluster/ray_patches.py).
        ray.init(address=address, namespace="serve", logging_level="WARNING",
                 runtime_env={"worker_process_setup_hook": HOOK, "env_vars": listener_env(cfg)})
    else:
        kwargs = dict(include_dashboard=False, namespace="serve", logging_level="WARNING",
                      runtime_env={"worker_process_setup_hook": HOOK},
                      object_store_memory=int(os.environ.get("KVMESH_OBJECT_STORE_BYTES",
                                                             DEFAULT_OBJECT_STORE_BYTES)))
        if loopback:
            kwargs["_node_ip_address"] = "127.0.0.1"
        if cfg.replicas.num_gpus == 0:
            # CPU workers reserve num_cpus each; logical CPUs are not cores, so let the replicas
            # (and the ingress and proxies beside them) fit even on a 2-core machine.
            kwargs["num_cpus"] = max(os.cpu_count() or 1,
                                     int(cfg.replicas.num_cpus * (cfg.autoscaling.max_replicas
                                                                   if cfg.autoscaling.enabled
                                                                   else cfg.replicas.num_replicas)) + 2)
        # "local": a Ray of its own, never the one RAY_ADDRESS or a `ray start` on this machine
        # names (ray.init() would join that one, without this job's environment).
        init_local_ray(kwargs, out)
    return ray.get_runtime_context().gcs_address


# Ray waits a fixed 30 s for a new node's raylet to register with its GCS (ray/_private/node.py);
# on a loaded machine (two clusters starting on 2 cores) that can run out once.
RAY_NODE_TIMEOUT_TEXT = "timed out during startup"
RAY_START_ATTEMPTS = 2


def init_local_ray(kwargs: dict, out=sys.stdout, attempts: int = RAY_START_ATTEMPTS) -> None:
    """ray.init(address="local", **kwargs), started again when Ray's node timed out registering.
    A failed attempt's processes (GCS, raylet, reaper, agents: children of this process that it
    started; Ray holds no handle on them, its node object never returned) are killed by pid first,
    whatever the failure, so none outlives a `kvmesh serve` that gives up."""
    import psutil  # Ray's own dependency (imported with ray)
    import ray

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception as e:
            # what the failed attempt started outlives this process otherwise
            stray = [p for p in me.children(recursive=True) if p.pid not in before]
            for p in stray:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(stray, timeout=10)
            if RAY_NODE_TIMEOUT_TEXT not in str(e) or attempt == attempts:
                raise
            print(f"Ray's node did not register in time ({e.__class__.__name__}: {e}); "
                  f"stopped its {len(stray)} processes, starting Ray again "
                  f"(attempt {attempt + 1} of {attempts})", file=out, flush=True)


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b[^:]*: ")


class DeployError(RuntimeError):
    """Serve could not start the application; the message holds each failed deployment's reason."""


def deployment_failures(app_name: str, max_chars: int = 2000) -> str:
    """Why each deployment of the app that is not healthy failed, from Serve's status (the last line
    of each replica's error: the exception), or "" when Serve cannot say."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
    except Exception:
        return ""
    if app is None:
        return ""
    reasons = []
    for name, dep in app.deployments.items():
        if dep.status == "HEALTHY":  # DeploymentStatus is a str enum
            continue
        lines = [line.strip() for line in (dep.message or "").strip().splitlines() if line.strip()]
        if not lines:
            continue
        # from the last line that starts an exception ("ValueError: ..."), which may run on
        # over several lines (transformers' messages do), to the end
        starts = [i for i, line in enumerate(lines) if EXCEPTION_LINE.match(line)]
        reason = " ".join(lines[starts[-1]:] if starts else lines[-1:])
        reasons.append(f"{name}: {reason[:max_chars]}")
    return "; ".join(reasons)


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextmanager
def _quiet(logger_name: str, prefix: str):
    """Drop `logger_name`'s records that start with `prefix` for the duration."""
    log, drop = logging.getLogger(logger_name), _DropMessages(prefix)
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


# Serve's controller gives a new proxy RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (5 s) to answer its
# ready check, then kills it and starts another with longer; serve.start waits on the first proxy
# only, and raised its ActorDiedError ("killed by `ray.kill`") while Serve went on (`kvmesh serve
# --address` in CI, once, with other load on the 2 cores). Started again, serve.start connects to
# the controller just made; wait_for_proxies then waits for the proxy that replaced it.
SERVE_START_ATTEMPTS = 3
PROXY_WAIT_S = 120.0


def start_serve(http_options, grpc_options, out=sys.stdout, attempts: int = SERVE_START_ATTEMPTS) -> None:
    """serve.start, again when its proxy was killed before it was ready. Any other failure, or the
    last attempt's, is raised as it was."""
    from ray import serve
    from ray.exceptions import ActorDiedError

    for attempt in range(1, attempts + 1):
        try:
            with _quiet("ray.serve", "Connecting to existing Serve app"):
                serve.start(http_options=http_options, grpc_options=grpc_options)
            return
        except ActorDiedError as e:
            if "ProxyActor" not in str(e) or attempt == attempts:
                raise
            grace = os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "5")  # Ray's default
            print(f"Serve's proxy was stopped before it was ready (a busy machine: Serve gives it "
                  f"{grace} s, then starts another); waiting for the next one (attempt {attempt + 1} of "
                  f"{attempts})", file=out, flush=True)


def wait_for_proxies(timeout_s: float = PROXY_WAIT_S) -> None:
    """Until Serve's proxy on this process's node is healthy (with none there, any node's), or
    timeout_s; then DeployError naming each proxy's status. Other nodes' proxies are not waited
    for: a node joining the cluster starts its own when it can."""
    import ray
    from ray import serve

    here = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout_s
    while True:
        proxies = {node: getattr(status, "value", str(status))
                   for node, status in serve.status().proxies.items()}
        mine = [proxies[here]] if here in proxies else list(proxies.values())
        if "HEALTHY" in mine:
            return
        if time.monotonic() > deadline:
            raise DeployError(f"Serve's proxy was not ready within {timeout_s:.0f} s: "
                              f"{proxies or 'no proxy'}")
        time.sleep(0.2)


def deploy(cfg: ServeConfig, out=sys.stdout) -> dict[str, str]:
    """Start Serve's proxies and deploy the app; returns the endpoints once the proxies are ready."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from kvmesh.cluster.app import build_app
    from kvmesh.cluster.grpc_health import servicer_functions

    grpc = None
    if cfg.server.grpc_port:
        grpc = gRPCOptions(port=cfg.server.grpc_port,
                           grpc_servicer_functions=servicer_functions(cfg.server.grpc_reflection),
                           enable_reflection=cfg.server.grpc_reflection)
    start_serve(HTTPOptions(host=cfg.server.host, port=cfg.server.http_port,
                            keep_alive_timeout_s=cfg.server.keep_alive_timeout_s), grpc, out)
    try:
        # serve.run connects to the Serve just started and logs that "New http_options/
        # controller_options will not be applied": they were, by serve.start above.
        with _quiet("ray.serve", "Connecting to existing Serve app"):
            serve.run(build_app(cfg.to_dict()), name=cfg.app_name, route_prefix=cfg.route_prefix,
                      blocking=False)
    except RuntimeError as e:  # Serve's message names the deployments, not why they failed
        raise DeployError(f"{e} {deployment_failures(cfg.app_name)}".strip()) from None
    wait_for_proxies()
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    prefix = cfg.route_prefix.rstrip("/")
    endpoints = {"http": f"http://{host}:{cfg.server.http_port}{prefix}/v1"}
    if cfg.server.grpc_port:
        endpoints["grpc"] = f"{host}:{cfg.server.grpc_port}"
    if cfg.server.direct_http_port:
        endpoints["http_direct"] = f"http://{host}:{cfg.server.direct_http_port}/v1"  # the app at its root
    return endpoints


def initial_workers(cfg: ServeConfig) -> int:
    """The worker replicas the deployment starts with: num_replicas, or autoscaling's min_replicas."""
    return cfg.autoscaling.min_replicas if cfg.autoscaling.enabled else cfg.replicas.num_replicas


def wait_for_workers(cfg: ServeConfig, timeout_s: float = 60.0):
    """After the deploy: until the worker replicas the deployment starts with (num_replicas, or
    autoscaling's min_replicas) have reported their load to the KV event hub as healthy, a second or
    so after Serve calls them healthy, or timeout_s. So the ready line is printed when /health
    answers ok and counts them all. Returns the last cluster_health."""
    import ray

    from kvmesh.cluster.event_hub import NAMESPACE, hub_name
    from kvmesh.cluster.status import cluster_health

    want = initial_workers(cfg)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            hub = ray.get_actor(hub_name(cfg.app_name), namespace=NAMESPACE)
            loads = ray.get(hub.loads.remote(), timeout=10)[0]
        except Exception:  # noqa: BLE001 (the hub not created or not answering yet: ask again)
            loads = None
        health = cluster_health(loads, cfg.scales_to_zero)
        if (health.serving and health.workers >= want) or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def ready_notes(cfg: ServeConfig, health) -> list[str]:
    """What `kvmesh serve` says above its ready line when wait_for_workers ran out of time: that no
    worker reported (so /health answers 503 until one does), or how many of the replicas it starts
    with did (not under autoscaling, where the count moves)."""
    if not health.serving:
        return [f"kvmesh serve: no worker has reported to the KV event hub yet ({health.status}); "
                "/health answers 503 until one does"]
    if not cfg.autoscaling.enabled and health.workers < initial_workers(cfg):
        return [f"kvmesh serve: {health.workers} of {initial_workers(cfg)} worker replicas have "
                "reported to the KV event hub so far"]
    return []


def shutdown(cfg: ServeConfig, own_ray: bool) -> None:
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from kvmesh.cluster.event_hub import kill_hub
    from kvmesh.cluster.response_store import kill_store

    try:
        try:
            serve.delete(cfg.app_name)
        except RayServeException as e:  # Serve never started (the deploy failed before
            if "no Serve instance running" not in str(e):  # serve.start): nothing to delete, and
                raise  # the failure that got here is the one to report
        kill_hub(cfg.app_name)
        kill_store(cfg.app_name)
    finally:
        if own_ray:  # the app's replicas have drained: stopping Ray ends Serve's controller and
            ray.shutdown()  # proxies (serve.shutdown() only added Ray's "graceful_shutdown failed")


def fit_to_this_machine(cfg: ServeConfig, address: str | None, out=sys.stdout) -> ServeConfig:
    """On a local Ray without a GPU, `device: auto` means CPU replicas: ask Ray for no GPU instead
    of waiting forever for one. `device: cuda` without a GPU, or more GPUs per replica than the
    machine has, is an error naming what is missing."""
    if address is not None or cfg.replicas.num_gpus == 0:
        return cfg
    gpus = _local_gpus()
    if gpus > 0:
        if cfg.replicas.num_gpus > gpus:  # Serve would wait for it forever
            raise ValueError(f"replicas.num_gpus is {cfg.replicas.num_gpus:g} (engine.tensor_parallel_size "
                             f"{cfg.engine.tensor_parallel_size}) but this machine has {gpus} GPU(s): no "
                             f"worker replica could be placed; lower both, or use --address to join a "
                             f"cluster with larger GPU nodes")
        return cfg
    if cfg.engine.device == "cuda":
        raise ValueError("engine.device is cuda but this machine has no CUDA GPU for Ray to give "
                         "the worker replicas (replicas.num_gpus > 0); use --device cpu, or "
                         "--address to join a cluster with GPU nodes")
    print("kvmesh serve: no GPU here; running the worker replicas on the CPU "
          "(replicas.num_gpus: 0)", file=out)
    data = cfg.to_dict()
    data["replicas"]["num_gpus"] = 0
    return ServeConfig.model_validate(data)


def _local_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def check_model_here(cfg: ServeConfig) -> None:
    """A local cluster's replicas load the model from this machine: a --model that names nothing
    loadable, or a checkpoint of an architecture or a config the engine does not support, is an
    error here, before Ray starts (ValueError naming `model` or the config field), not a deployment
    that fails in a replica a minute later; so is a reasoning_parser whose markers the tokenizer
    lacks. Converts the default model once, for the replicas to
    find in the cache."""
    from kvmesh.worker.loader import load_tokenizer_for, resolve_model
    from kvmesh.worker.model_builder import model_config_of

    try:
        source = resolve_model(cfg.model)
    except FileNotFoundError as e:  # the default model's package is not installed
        raise ValueError(f"model: {e}") from None
    model_config_of(source)  # what each worker reads first, refusals included
    tokenizer = load_tokenizer_for(source)  # the ingress's first step
    if cfg.server.reasoning_parser is not None:  # the ingress's next (Frontend): its markers
        from kvmesh.cluster.reasoning import ReasoningParser

        ReasoningParser.for_tokenizer(cfg.server.reasoning_parser, tokenizer)


def serve_forever(cfg: ServeConfig, address: str | None, out=sys.stdout) -> int:
    cfg = fit_to_this_machine(cfg, address, out)
    if address is None:
        check_model_here(cfg)
    ray_address = start_ray(cfg, address, out)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        started = time.monotonic()
        endpoints = deploy(cfg, out)
        for note in ready_notes(cfg, wait_for_workers(cfg)):
            print(note, file=out)
        print(f"kvmesh serving {cfg.model} on {cfg.replicas.num_replicas} worker replica(s), "
              f"routing {cfg.routing.policy} (ready in {time.monotonic() - started:.1f} s)", file=out)
        print(f"  OpenAI HTTP: {endpoints['http']}", file=out)
        if "http_direct" in endpoints:
            print(f"  OpenAI HTTP: {endpoints['http_direct']} (direct to the ingress replicas)", file=out)
        if "grpc" in endpoints:
            print(f"  gRPC:        {endpoints['grpc']} (kvmesh.v1.Generation)", file=out)
        print(f"  ray:         {ray_address}", file=out)
        print("Ctrl-C stops it.", file=out, flush=True)
        stop.wait()
    finally:
        shutdown(cfg, own_ray=address is None)
    return 0
