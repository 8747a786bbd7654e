"""docs/DEPLOY.md "Kubernetes (Helm, KubeRay)": behaviours it states of the chart that no other
unit test would catch if they stopped being true. The doc's own `helm install` / `helm upgrade`
commands are read from the page, their --set flags parsed by Helm's own parser, and rendered with
the release name and namespace the page uses (kvmesh, llm)."""

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helm_support

from helm_support import CHART, crd_errors, helm, manifests, one  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "DEPLOY.md"
RELEASE = "kvmesh"  # as in the doc's commands (`helm install kvmesh ./helm/kvmesh -n llm`)


def _doc_helm_commands() -> list[list[str]]:
    """argv of every `helm install|upgrade kvmesh ./helm/kvmesh` in the doc's shell blocks, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] in (["helm", "install"], ["helm", "upgrade"]) and words[3:4] == ["./helm/kvmesh"]:
                commands.append(words)
    return commands


def _values_of(argv: list[str]) -> dict:
    values: dict = {}
    for flag, expression in zip(argv, argv[1:]):
        parse = {"--set": helm.parse_set_string, "--set-string": helm.parse_set_string_values}.get(flag)
        if parse:
            _merge(values, parse(expression))
    return values


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            for index, item in enumerate(value):  # Helm's --set a[0].b=... then a[0].c=...
                if index < len(into[key]) and isinstance(item, dict) and isinstance(into[key][index], dict):
                    _merge(into[key][index], item)
                elif index < len(into[key]):
                    into[key][index] = item
                else:
                    into[key].append(item)
        else:
            into[key] = value


def _doc_releases() -> list[tuple[list[str], dict]]:
    """Each doc command with the values the release has after it (`--reuse-values` keeps the earlier ones)."""
    values: dict = {}
    steps = []
    for argv in _doc_helm_commands():
        assert argv[2] == RELEASE and argv[argv.index("-n") + 1] == "llm", argv
        if argv[1] == "upgrade":
            assert "--reuse-values" in argv, argv
        _merge(values, _values_of(argv))
        steps.append((argv, json.loads(json.dumps(values))))
    return steps


def test_the_doc_has_the_install_and_each_upgrade_it_describes():
    """The parser finds them all: the install, then Ingress, Gateway, Ray token Secret, hub model."""
    kinds = [argv[1] for argv, _ in _doc_releases()]
    assert kinds == ["install"] + ["upgrade"] * 4, kinds


@pytest.mark.parametrize("step", range(len(_doc_helm_commands())))
def test_each_helm_command_of_the_doc_renders_a_rayservice_kuberay_accepts(step):
    """DEPLOY.md: the install, the Ingress / Gateway, Ray token Secret and hub-model upgrades as
    written, each on the values of the ones before (`--reuse-values`)."""
    argv, values = _doc_releases()[step]
    objects = manifests(values, release=RELEASE)
    rayservice = one(objects, "RayService")
    assert rayservice["metadata"]["name"] == "kvmesh"  # kubectl -n llm get rayservice kvmesh
    assert one(objects, "Service", "-http")["metadata"]["name"] == "kvmesh-http"  # svc/kvmesh-http
    report = helm.lint(CHART, values, strict=True, namespace="llm")
    assert report["errors"] == [], (argv, report)
    assert crd_errors(rayservice, "RayService") == []  # skips, naming the path, without shared/


def test_the_docs_upgrades_render_what_they_say():
    """DEPLOY.md: the image it pushed, an Ingress that does not buffer or time out streams, routes
    to a Gateway named "public" in "gateways", the Secret's token, and the hub model fetched into
    the cache by an init container with a 10 s startup probe period."""
    _, values = _doc_releases()[-1]
    objects = manifests(values, release=RELEASE)
    cluster = one(objects, "RayService")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    [worker] = [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    assert head["containers"][0]["image"] == "registry.example.com/kvmesh:0.1.0-cu128"
    annotations = one(objects, "Ingress")["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "3600"
    for kind in ("HTTPRoute", "GRPCRoute"):
        assert one(objects, kind)["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways"}]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "kvmesh-ray-token"}
    for pod in (head, worker):
        assert pod["initContainers"][0]["command"] == ["kvmesh", "fetch", "Qwen/Qwen3-8B"]
    assert worker["containers"][0]["startupProbe"]["periodSeconds"] == 10


def test_the_release_notes_print_the_docs_commands_to_reach_it():
    """DEPLOY.md: "(the release notes print these commands too: helm get notes kvmesh -n llm)"."""
    with helm.Chart.load(CHART) as chart:
        notes = chart.render(values=None, name=RELEASE, namespace="llm", is_install=True)["kvmesh/templates/NOTES.txt"]
    for command in ("kubectl -n llm get rayservice kvmesh -w",
                    "kubectl -n llm port-forward svc/kvmesh-http 8000:8000",
                    "kubectl -n llm port-forward svc/kvmesh-head-svc 8265:8265",
                    "kvmesh status --url"):
        assert command in notes


@pytest.mark.parametrize("variable, value", [
    ("KVMESH_LISTEN_HOST", "kvmesh.server.host"),
    ("KVMESH_MAX_HEADER_BYTES", "kvmesh.server.max_header_bytes"),
    ("KVMESH_HEADER_TIMEOUT_S", "kvmesh.server.header_timeout_s"),
    ("KVMESH_STREAM_IDLE_TIMEOUT_S", "kvmesh.server.stream_idle_timeout_s"),
    ("__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR", "kvmesh's worker hook"),
])
@pytest.mark.parametrize("group", ["head", "worker"])
def test_setting_a_chart_owned_variable_in_a_group_env_fails_naming_the_value_to_set(group, variable, value):
    """DEPLOY.md: "These variables are the chart's: setting one in head.env / worker.env fails at
    install, naming the value to set instead"."""
    with pytest.raises(helm.HelmError) as error:
        manifests({group: {"env": [{"name": variable, "value": "1"}]}}, release=RELEASE)
    assert f"{group}.env sets {variable}, which the chart sets on every Ray container from {value}" in str(error.value)


def test_service_http_type_loadbalancer_exposes_the_api():
    """DEPLOY.md: "service.http.type: LoadBalancer exposes the API outside the cluster"."""
    service = one(manifests({"service": {"http": {"type": "LoadBalancer"}}}, release=RELEASE), "Service", "-http")
    assert service["spec"]["type"] == "LoadBalancer"
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["serve"]


def test_the_model_cache_claim_is_kept_and_named_after_the_release():
    """DEPLOY.md: the claim made with modelCache.enabled and no existingClaim is kept
    (helm.sh/resource-policy: keep); `kubectl -n llm delete pvc kvmesh-model-cache`."""
    claim = one(manifests({"modelCache": {"enabled": True}}, release=RELEASE), "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "kvmesh-model-cache"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    kept = [o for o in manifests({"modelCache": {"enabled": True}}, release=RELEASE)
            if o["metadata"].get("annotations", {}).get("helm.sh/resource-policy") == "keep"]
    assert kept == [claim]  # everything else goes with `helm uninstall`


def _ray_cluster(values: dict) -> dict:
    return one(manifests(values, release=RELEASE), "RayService")["spec"]["rayClusterConfig"]


@pytest.mark.parametrize("kvmesh", [
    {"model": "random:tiny-llama"}, {"engine": {"max_model_len": 4096}}, {"routing": {"policy": "round_robin"}},
    {"replicas": {"max_ongoing_requests": 8}}, {"limits": {"max_prompt_tokens": 1000}},
    {"server": {"api_keys": ["sk-new"]}},
])
def test_app_only_kvmesh_changes_leave_the_ray_cluster_spec_as_it_was(kvmesh):
    """DEPLOY.md: "Changes to kvmesh: that only the Serve app reads ... update the app in place"
    (KubeRay starts a new cluster only when rayClusterConfig changes)."""
    assert _ray_cluster({"kvmesh": kvmesh}) == _ray_cluster({})


def test_changing_the_autoscaling_bounds_leaves_the_ray_cluster_spec_as_it_was():
    """DEPLOY.md: "... autoscaling bounds) update the app in place"."""
    def autoscaled(low, high):
        return _ray_cluster({"kvmesh": {"autoscaling": {"enabled": True, "min_replicas": low, "max_replicas": high}},
                             "worker": {"maxReplicas": 4}})
    assert autoscaled(1, 2) == autoscaled(2, 4)


@pytest.mark.parametrize("values", [
    {"kvmesh": {"server": {"http_port": 8100}}}, {"kvmesh": {"server": {"host": "::"}}},
    {"kvmesh": {"server": {"grpc_port": 9100}}}, {"kvmesh": {"server": {"max_header_bytes": 32768}}},
    {"kvmesh": {"server": {"header_timeout_s": 5}}}, {"kvmesh": {"server": {"stream_idle_timeout_s": 5}}},
    {"kvmesh": {"server": {"keep_alive_timeout_s": 9}}}, {"kvmesh": {"server": {"grpc_reflection": True}}},
    {"kvmesh": {"autoscaling": {"enabled": True}}},
])
def test_kvmesh_settings_the_pods_carry_change_the_ray_cluster_spec(values):
    """DEPLOY.md: "kvmesh.server's ports, host and header and stream settings, its
    keep_alive_timeout_s and grpc_reflection, kvmesh.autoscaling.enabled, and the model when
    modelCache.prefetch is on" are in the pods' spec."""
    assert _ray_cluster(values) != _ray_cluster({})


def test_a_prefetched_models_change_changes_the_ray_cluster_spec():
    prefetch = {"modelCache": {"enabled": True, "prefetch": True}}
    assert _ray_cluster({**prefetch, "kvmesh": {"model": "random:tiny-llama"}}) != _ray_cluster(prefetch)


def test_every_ray_pod_carries_the_proxy_options_in_its_annotation():
    """DEPLOY.md: options Serve's proxies take only when they start; "the pods carry them in the
    annotation kvmesh.io/proxy-options", the head and every worker group."""
    from helm_values import VALUE_SETS

    values = {**VALUE_SETS["autoscaling-two-gpu-types"],
              "kvmesh": {**VALUE_SETS["autoscaling-two-gpu-types"]["kvmesh"],
                         "server": {"keep_alive_timeout_s": 9, "grpc_reflection": True}}}
    cluster = one(manifests(values, release=RELEASE), "RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    assert len(pods) >= 3
    for pod in pods:
        annotations = pod["template"]["metadata"]["annotations"]
        assert annotations["kvmesh.io/proxy-options"] == "keep_alive_timeout_s=9 grpc_reflection=true"


@pytest.mark.parametrize("kind", ["NodePort", "LoadBalancer"])
def test_service_grpc_type_is_clusterip_unless_set(kind):
    """DEPLOY.md: the Services are ClusterIP unless you set service.*.type (here the gRPC one)."""
    assert one(manifests({}, release=RELEASE), "Service", "-grpc")["spec"].get("type", "ClusterIP") == "ClusterIP"
    service = one(manifests({"service": {"grpc": {"type": kind}}}, release=RELEASE), "Service", "-grpc")
    assert service["spec"]["type"] == kind
