"""What a production install of the chart renders: names KubeRay accepts for any release name, the
model cache and hub credentials on every Ray pod, probe and scheduling overrides, PodDisruptionBudgets,
GCS fault tolerance, an authenticated ServiceMonitor, and an Ingress and Gateway API routes to the
Services (value set "production" in helm_values)."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helm_support, helm_values

from helm_support import manifests, one  # noqa: E402
from helm_values import VALUE_SETS  # noqa: E402

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RAYSERVICE_NAME = 47  # KubeRay: MaxRayClusterNameLength (53) minus its 6-character suffix


def ray_pods(objects) -> list[dict]:
    """The pod templates of the head and of every worker group."""
    cluster = one(objects, "RayService")["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def env_of(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("release", ["1st", "a", "llm-prod-us-east1-inference-blue-green-01", "x" * 53,
                                     "my.app", "kvmesh", "9-to-5"])
def test_every_release_name_gives_names_kuberay_and_kubernetes_accept(release):
    objects = manifests(release=release)
    name = one(objects, "RayService")["metadata"]["name"]
    assert DNS_1035.match(name) and len(name) <= MAX_RAYSERVICE_NAME, name
    for obj in objects:
        assert DNS_1035.match(obj["metadata"]["name"]) and len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]


def test_release_names_keep_their_readable_part():
    assert one(manifests(release="1st"), "RayService")["metadata"]["name"] == "kvmesh-1st-kvmesh"
    assert one(manifests(release="prod"), "RayService")["metadata"]["name"] == "prod-kvmesh"
    long = one(manifests(release="llm-prod-us-east1-inference-blue-green-01"), "RayService")["metadata"]["name"]
    assert long == "llm-prod-us-east1-inference-blue-green-01-kvmes"


def test_model_cache_hub_token_and_endpoint_reach_every_ray_container():
    objects = manifests(VALUE_SETS["production"])
    claim = one(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "demo-kvmesh-model-cache"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert (claim["spec"]["storageClassName"], claim["spec"]["resources"]["requests"]["storage"]) == ("filestore", "500Gi")
    pods = ray_pods(objects)
    assert len(pods) == 2
    for pod in pods:
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "demo-kvmesh-model-cache"}} \
            in pod["spec"]["volumes"]
        [container] = pod["spec"]["containers"]
        assert {"name": "model-cache", "mountPath": "/models"} in container["volumeMounts"]
        env = env_of(container)
        assert env["HF_HOME"] == "/models/huggingface" and env["KVMESH_CACHE"] == "/models/kvmesh"
        assert env["HF_ENDPOINT"] == "https://hub.example.internal"
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}


def test_prefetch_fetches_the_model_into_the_cache_before_ray_starts_on_every_pod():
    objects = manifests(VALUE_SETS["production"])
    for pod in ray_pods(objects):
        fetch = pod["spec"]["initContainers"][0]
        assert fetch["name"] == "fetch-model"
        assert fetch["command"] == ["kvmesh", "fetch", "Qwen/Qwen3-8B"]
        assert fetch["image"] == pod["spec"]["containers"][0]["image"]
        assert {"name": "model-cache", "mountPath": "/models"} in fetch["volumeMounts"]
        assert env_of(fetch)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    worker = ray_pods(objects)[1]
    assert [c["name"] for c in worker["spec"]["initContainers"]] == ["fetch-model", "nvidia-check"]


def test_an_existing_claim_is_mounted_and_none_is_created():
    objects = manifests({"modelCache": {"enabled": True, "existingClaim": "shared-models", "mountPath": "/mnt/m"}})
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    for pod in ray_pods(objects):
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-models"}} in pod["spec"]["volumes"]
        assert "initContainers" not in pod["spec"]
        assert env_of(pod["spec"]["containers"][0])["HF_HOME"] == "/mnt/m/huggingface"


def test_no_model_cache_means_no_volume_and_no_hub_env():
    for pod in ray_pods(manifests()):
        [container] = pod["spec"]["containers"]
        assert "volumes" not in pod["spec"] and "volumeMounts" not in container
        assert not {"HF_HOME", "HF_TOKEN", "HF_ENDPOINT", "KVMESH_CACHE"} & set(env_of(container))


def test_probe_and_scheduling_overrides_land_on_their_group_only():
    values = VALUE_SETS["production"]
    head, worker = ray_pods(manifests(values))
    [head_container], [worker_container] = head["spec"]["containers"], worker["spec"]["containers"]
    for key in ("startupProbe", "readinessProbe", "envFrom"):
        assert worker_container[key] == values["worker"][key]
        assert key not in head_container
    assert head_container["livenessProbe"] == values["head"]["livenessProbe"]
    assert "livenessProbe" not in worker_container  # KubeRay's own stays
    for key in ("topologySpreadConstraints", "priorityClassName", "runtimeClassName"):
        assert worker["spec"][key] == values["worker"][key]
    assert worker["spec"]["securityContext"] == {"fsGroup": 1000}
    assert head["spec"]["priorityClassName"] == "inference-high"
    assert "runtimeClassName" not in head["spec"]


def test_disruption_budgets_select_the_head_and_the_workers():
    objects = manifests(VALUE_SETS["production"])
    head_pdb, workers_pdb = one(objects, "PodDisruptionBudget", "-head"), one(objects, "PodDisruptionBudget", "-workers")
    assert head_pdb["spec"]["maxUnavailable"] == 0 and workers_pdb["spec"]["maxUnavailable"] == 1
    head, worker = ray_pods(objects)
    for pdb, pod in ((head_pdb, head), (workers_pdb, worker)):
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
    assert workers_pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert not [o for o in manifests() if o["kind"] == "PodDisruptionBudget"]  # off by default


def test_gcs_fault_tolerance_points_the_raycluster_at_redis():
    cluster = one(manifests(VALUE_SETS["production"]), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.llm.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-password", "key": "password"}}}}
    assert "gcsFaultToleranceOptions" not in one(manifests(), "RayService")["spec"]["rayClusterConfig"]


def test_service_monitor_sends_a_key_when_metrics_need_one():
    monitor = one(manifests(VALUE_SETS["production"]), "ServiceMonitor")
    kvmesh, ray = monitor["spec"]["endpoints"]
    assert kvmesh["authorization"] == {"type": "Bearer",
                                       "credentials": {"name": "kvmesh-prometheus-key", "key": "api-key"}}
    assert "authorization" not in ray  # Ray's metrics port has no key
    fallback = one(manifests({"kvmesh": {"server": {"auth_metrics": True}}, "apiKeysSecret": {"name": "keys"},
                              "metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    assert fallback["spec"]["endpoints"][0]["authorization"]["credentials"] == {"name": "keys", "key": "api-keys"}


def test_extra_objects_are_rendered_through_tpl():
    configmap = one(manifests(VALUE_SETS["production"]), "ConfigMap", "kvmesh-extra-env")
    assert configmap["metadata"]["labels"]["release"] == "demo"
    assert configmap["data"] == {"NCCL_DEBUG": "WARN"}


def test_ingress_routes_its_hosts_and_paths_to_the_http_service():
    objects = manifests(VALUE_SETS["production"])
    ingress, service = one(objects, "Ingress"), one(objects, "Service", "-http")
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert ingress["spec"]["tls"] == [{"secretName": "llm-example-tls", "hosts": ["llm.example.com"]}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/v1", "Prefix")
    assert path["backend"]["service"] == {"name": service["metadata"]["name"],
                                          "port": {"number": service["spec"]["ports"][0]["port"]}}


def test_ingress_with_the_default_host_matches_any_host():
    (rule,) = one(manifests({"ingress": {"enabled": True}}), "Ingress")["spec"]["rules"]
    assert "host" not in rule and rule["http"]["paths"][0]["path"] == "/"


def test_gateway_routes_attach_to_the_gateway_and_reach_both_services():
    objects = manifests(VALUE_SETS["production"])
    http_route, grpc_route = one(objects, "HTTPRoute"), one(objects, "GRPCRoute")
    http_service, grpc_service = one(objects, "Service", "-http"), one(objects, "Service", "-grpc")
    assert http_route["apiVersion"] == grpc_route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert http_route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways", "sectionName": "https"}]
    assert http_route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = http_route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["timeouts"] == {"request": "0s"}
    assert rule["backendRefs"] == [{"name": http_service["metadata"]["name"],
                                    "port": http_service["spec"]["ports"][0]["port"]}]
    assert grpc_route["spec"]["rules"] == [{"backendRefs": [{"name": grpc_service["metadata"]["name"],
                                                             "port": grpc_service["spec"]["ports"][0]["port"]}]}]


def test_no_ingress_or_routes_by_default():
    assert not [o for o in manifests() if o["kind"] in ("Ingress", "HTTPRoute", "GRPCRoute")]
