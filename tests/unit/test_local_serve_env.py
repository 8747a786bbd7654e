"""The environment a local `kvmesh serve` gives the Ray it starts (cluster/launcher.py): Ray Serve's
throughput-optimized mode on and its direct ingress off (docs/DEPLOY.md, docs/SERVING.md), unless
the user's own environment says otherwise; a cluster joined with --address is left as its nodes
were started. Serve's processes read these when they start, so they must be in the environment
when ray.init runs: ray.init is replaced by one that records that environment (and its arguments)
and stops, so no Ray starts."""

import io
import os

import pytest
import ray

from kvmesh.cluster import launcher
from kvmesh.serve_config import ServeConfig

THROUGHPUT_OPTIMIZED = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


class RayInitCalled(Exception):
    pass


@pytest.fixture
def ray_init(monkeypatch):
    """Start from an environment without the variables start_ray sets, token auth off so nothing
    is written under ~/.ray; the test process's environment is put back afterwards, whatever
    start_ray wrote. Yields what the replaced ray.init saw: its keyword arguments and os.environ."""
    saved = dict(os.environ)
    for name in [*launcher.SERVE_FAST_PATH_ENV, *launcher.listener_env(ServeConfig()),
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    seen = {}

    def init(**kwargs):
        seen.update(kwargs=kwargs, environ=dict(os.environ))
        raise RayInitCalled

    monkeypatch.setattr(ray, "init", init)
    yield seen
    os.environ.clear()
    os.environ.update(saved)


def start_ray(address=None):
    with pytest.raises(RayInitCalled):
        launcher.start_ray(ServeConfig(), address, out=io.StringIO())


def test_the_fast_path_is_throughput_optimized_mode_without_direct_ingress():
    assert launcher.SERVE_FAST_PATH_ENV == {THROUGHPUT_OPTIMIZED: "1", DIRECT_INGRESS: "0"}


def test_a_local_serve_starts_ray_with_serves_throughput_optimized_mode(ray_init):
    start_ray()
    environ = ray_init["environ"]
    assert environ[THROUGHPUT_OPTIMIZED] == "1"
    assert environ[DIRECT_INGRESS] == "0"
    # the worker hook's settings travel the same way (listener_env)
    assert {k: environ.get(k) for k in launcher.listener_env(ServeConfig())} == launcher.listener_env(ServeConfig())


@pytest.mark.parametrize("name, value", [(THROUGHPUT_OPTIMIZED, "0"), (DIRECT_INGRESS, "1")])
def test_the_users_own_setting_wins(ray_init, monkeypatch, name, value):
    """docs/DEPLOY.md: set RAY_SERVE_THROUGHPUT_OPTIMIZED=0 to run Serve's default path."""
    monkeypatch.setenv(name, value)
    start_ray()
    assert ray_init["environ"][name] == value
    other = DIRECT_INGRESS if name == THROUGHPUT_OPTIMIZED else THROUGHPUT_OPTIMIZED
    assert ray_init["environ"][other] == launcher.SERVE_FAST_PATH_ENV[other]


def test_joining_a_cluster_keeps_what_its_nodes_were_started_with(ray_init):
    """docs/DEPLOY.md: a cluster joined with --address keeps its nodes' Serve mode: neither this
    process's environment nor the job's runtime_env sets it."""
    start_ray(address="auto")
    assert ray_init["kwargs"]["address"] == "auto"
    env_vars = ray_init["kwargs"]["runtime_env"]["env_vars"]
    for name in launcher.SERVE_FAST_PATH_ENV:
        assert name not in ray_init["environ"] and name not in env_vars


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("0.0.0.0", False)])
def test_a_local_serve_starts_ray_on_the_loopback_with_the_hook_and_no_dashboard(ray_init, host, loopback):
    """SERVING.md / DEPLOY.md: a local `kvmesh serve` starts Ray with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    and _node_ip_address=127.0.0.1 (its listeners on the loopback; neither when server.host opens
    it), no dashboard, and kvmesh's worker_process_setup_hook in the job's runtime_env."""
    from kvmesh.cluster.ray_patches import HOOK

    with pytest.raises(RayInitCalled):
        launcher.start_ray(ServeConfig(server={"host": host}), None, out=io.StringIO())
    kwargs = ray_init["kwargs"]
    assert (ray_init["environ"].get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0") is loopback
    assert kwargs["include_dashboard"] is False
    assert kwargs["runtime_env"]["worker_process_setup_hook"] == HOOK
    assert (kwargs.get("_node_ip_address") == "127.0.0.1") is loopback
