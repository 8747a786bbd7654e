"""API keys (cluster/auth.py): which keys are accepted, from where, for which endpoints; and the Helm
chart handing them over from a Kubernetes Secret instead of the RayService object."""

import sys
from pathlib import Path

import pytest

from kvmesh.cluster.auth import ApiKeys, bearer_token, keys_from_env
from kvmesh.serve_config import parse_config

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helm_support

from helm_support import manifests, one, serve_config  # noqa: E402


class _Ctx:
    def __init__(self, metadata):
        self._metadata = metadata

    def invocation_metadata(self):
        return self._metadata


def test_no_keys_means_every_endpoint_is_open():
    keys = ApiKeys([])
    assert not keys.enabled
    assert keys.allows("api", None) and keys.allows("metrics", None)
    assert keys.allows_grpc("api", _Ctx([]))


def test_any_configured_key_is_accepted_as_a_bearer_token_and_nothing_else():
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.allows("api", "Bearer sk-one") and keys.allows("api", "bearer sk-two")
    for header in (None, "", "Bearer", "Bearer ", "sk-one", "Basic sk-one", "Bearer sk-on",
                   "Bearer sk-one2", "Bearer \udc80"):
        assert not keys.allows("api", header), header


def test_grpc_reads_the_authorization_metadata():
    keys = ApiKeys(["sk-one"])
    assert keys.allows_grpc("api", _Ctx([("authorization", "Bearer sk-one")]))
    assert not keys.allows_grpc("api", _Ctx([("authorization", "Bearer nope")]))
    assert not keys.allows_grpc("api", _Ctx([("x-api-key", "sk-one")]))
    assert not keys.allows_grpc("api", None)


def test_health_and_metrics_are_open_unless_configured():
    open_keys = ApiKeys(["k"])
    assert open_keys.allows("health", None) and open_keys.allows("metrics", None)
    closed = ApiKeys(["k"], protect_health=True, protect_metrics=True)
    assert not closed.allows("health", None) and not closed.allows("metrics", None)
    assert closed.allows("health", "Bearer k") and closed.allows("metrics", "Bearer k")


def test_keys_from_the_config_and_the_environment_add_up():
    server = parse_config({"server": {"api_keys": ["from-config"], "auth_health": True}}).server
    keys = ApiKeys.from_server_config(server, {"KVMESH_API_KEYS": "env-a, env-b\nenv-c"})
    assert len(keys) == 4 and keys.protect_health and not keys.protect_metrics
    for k in ("from-config", "env-a", "env-b", "env-c"):
        assert keys.allows("api", f"Bearer {k}")
    assert keys_from_env({}) == []


@pytest.mark.parametrize("raw", ["", " , ", "\n"])
def test_a_set_keys_variable_without_a_key_is_refused(raw):
    """An empty Secret must not turn authentication off without a word."""
    with pytest.raises(ValueError, match="KVMESH_API_KEYS is set but holds no key"):
        keys_from_env({"KVMESH_API_KEYS": raw})


@pytest.mark.parametrize("key, what", [("", "empty"), (" sk-a", "whitespace"), ("sk a", "whitespace")])
def test_an_empty_or_spaced_key_in_the_config_is_refused(key, what):
    with pytest.raises(ValueError, match=rf"server\.api_keys: .*api_keys\[1\] is .*{what}"):
        parse_config({"server": {"api_keys": ["sk-ok", key]}})


def test_repr_never_shows_a_key():
    keys = ApiKeys(["sk-secret-value"])
    assert "sk-secret" not in repr(keys) and "sk-secret" not in str(keys)


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER  abc ") == "abc"
    assert bearer_token("Token abc") is None


def _container_env(container):
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("extra_env", [[], [{"name": "FOO", "value": "1"}]])
def test_helm_chart_feeds_kvmesh_api_keys_from_a_secret_to_every_ray_pod(extra_env):
    values = {"apiKeysSecret": {"name": "kvmesh-keys", "key": "keys"},
              "head": {"env": extra_env}, "worker": {"env": extra_env}}
    rs = one(manifests(values), "RayService")
    spec = rs["spec"]["rayClusterConfig"]
    containers = [spec["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [g["template"]["spec"]["containers"][0] for g in spec["workerGroupSpecs"]]
    for c in containers:
        env = _container_env(c)
        assert env["KVMESH_API_KEYS"]["valueFrom"] == {
            "secretKeyRef": {"name": "kvmesh-keys", "key": "keys"}}
        assert ("FOO" in env) == bool(extra_env)
    # the keys themselves are nowhere in the RayService
    assert serve_config(rs)["applications"][0]["args"]["server"]["api_keys"] == []


def test_helm_chart_without_a_secret_sets_no_key_variable():
    rs = one(manifests(), "RayService")
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "KVMESH_API_KEYS" not in _container_env(head)
