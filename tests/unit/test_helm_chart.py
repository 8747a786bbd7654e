"""The kvmesh Helm chart: lint, render, the serving config it hands to Serve, refused values."""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helm_support, helm_values

from helm_support import CHART, NAMESPACE, REPO, helm, manifests, one, render, serve_config  # noqa: E402
from helm_values import BAD_VALUES, VALUE_SETS  # noqa: E402

from kvmesh import serve_config as serving  # noqa: E402
from kvmesh.cluster import launcher  # noqa: E402


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_strict_is_clean(name):
    report = helm.lint(CHART, VALUE_SETS[name] or None, strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and report["messages"] == [], report


def test_default_render_has_rayservice_and_api_services():
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in manifests())
    assert kinds == [("RayService", "demo-kvmesh"), ("Service", "demo-kvmesh-grpc"), ("Service", "demo-kvmesh-http")]


def test_no_service_exposes_the_direct_http_port():
    """docs/SERVING.md: the ingress replicas' own HTTP port (server.direct_http_port) is for the
    pods' network only; the chart's Services carry the proxy's ports alone."""
    port = 8123
    objects = manifests({"kvmesh": {"server": {"direct_http_port": port}},
                         "metrics": {"serviceMonitor": {"enabled": True}}})
    assert f"direct_http_port: {port}" in one(objects, "RayService")["spec"]["serveConfigV2"]  # it is on
    services = [o for o in objects if o["kind"] == "Service"]
    assert len(services) >= 2
    for service in services:
        ports = {p.get("port") for p in service["spec"]["ports"]} | {p.get("targetPort") for p in service["spec"]["ports"]}
        assert port not in ports, service["metadata"]["name"]


def test_default_upgrade_strategy_is_new_cluster():
    """A spec change brings up a new RayCluster and switches traffic once it serves (docs/DEPLOY.md)."""
    assert one(manifests(), "RayService")["spec"]["upgradeStrategy"] == {"type": "NewCluster"}


def test_serve_config_carries_the_kvmesh_config_as_build_app_args():
    values = VALUE_SETS["autoscaling-two-gpu-types"]
    with helm.Chart.load(CHART) as chart:
        merged = chart.merge_values(values)
    config = serve_config(one(manifests(values), "RayService"))
    [app] = config["applications"]
    assert app["import_path"] == "kvmesh.cluster.app:build_app"
    assert app["route_prefix"] == "/"
    # The whole serving config, untouched (Helm drops keys whose value is null: build_app's defaults
    # apply), with the gRPC message limit the pods apply (serve.grpcMaxMessageBytes)
    expected = merged["kvmesh"]
    expected["server"]["grpc_max_message_bytes"] = merged["serve"]["grpcMaxMessageBytes"]
    assert app["args"] == expected
    assert app["args"]["model"] == "/models/Qwen3-8B"
    assert app["args"]["autoscaling"]["policy"] == "kv_pressure"
    assert app["args"]["engine"]["max_model_len"] == 8192
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000, "keep_alive_timeout_s": 90}
    assert config["grpc_options"]["port"] == 9000
    assert config["grpc_options"]["enable_reflection"] is False
    assert config["proxy_location"] == "EveryNode"


def test_default_args_are_the_serving_config_defaults_listening_on_all_interfaces():
    args = serve_config(one(manifests(), "RayService"))["applications"][0]["args"]
    expected = serving.ServeConfig().to_dict()
    expected["server"]["host"] = "0.0.0.0"  # reachable from the Services, unlike the local default
    assert serving.parse_config(args).to_dict() == expected


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_args_pass_the_serving_config_validation(name):
    args = serve_config(one(manifests(VALUE_SETS[name]), "RayService"))["applications"][0]["args"]
    serving.parse_config(args)


def test_values_and_schema_offer_exactly_the_serving_config_fields():
    fields = {name for name, _ in serving.describe_fields()}
    values = yaml.safe_load((CHART / "values.yaml").read_text())["kvmesh"]
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["kvmesh"]
    # the gRPC message limit is serve.grpcMaxMessageBytes (the chart puts it into the config)
    assert _dotted_keys(values) == fields - {"server.grpc_max_message_bytes"}
    assert _dotted_schema_keys(schema) == fields


def _dotted_keys(mapping: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in mapping.items():
        keys.add(prefix + key)
        if isinstance(value, dict) and key != "resources":
            keys |= _dotted_keys(value, prefix + key + ".")
    return keys


def _dotted_schema_keys(schema: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, sub in schema.get("properties", {}).items():
        keys.add(prefix + key)
        keys |= _dotted_schema_keys(sub, prefix + key + ".")
    return keys


def test_gpu_worker_groups_request_nvidia_gpus_and_head_requests_none():
    spec = one(manifests(VALUE_SETS["autoscaling-two-gpu-types"]), "RayService")["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert sorted(groups) == ["gpu", "h200"]  # "spare" is disabled
    for group in groups.values():
        [container] = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert (groups["gpu"]["minReplicas"], groups["gpu"]["replicas"], groups["gpu"]["maxReplicas"]) == (2, 2, 8)
    assert groups["h200"]["rayStartParams"]["resources"] == '"{\\"H200\\": 1}"'
    [head] = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in json.dumps(head["resources"])
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 60


def test_autoscaler_is_off_unless_kvmesh_autoscaling_is_enabled():
    spec = one(manifests(), "RayService")["spec"]["rayClusterConfig"]
    assert spec["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in spec


def _ray_container_envs(values: dict | None) -> dict[str, dict[str, dict]]:
    """Container name (head, or the worker group's name) -> its env, name -> the env entry."""
    spec = one(manifests(values), "RayService")["spec"]["rayClusterConfig"]
    containers = {"head": spec["headGroupSpec"]["template"]["spec"]["containers"]}
    containers |= {g["groupName"]: g["template"]["spec"]["containers"] for g in spec["workerGroupSpecs"]}
    envs = {}
    for name, [container] in containers.items():
        envs[name] = {e["name"]: e for e in container["env"]}
        assert len(envs[name]) == len(container["env"]), f"{name}: an env variable is set twice"
    return envs


def test_every_ray_node_runs_serve_throughput_optimized_unless_turned_off():
    for env in _ray_container_envs(None).values():  # as a local `kvmesh serve` starts Ray (cluster/launcher.py)
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"]["value"] == "1"
        assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"]["value"] == "0"
    for env in _ray_container_envs({"serve": {"throughputOptimized": False}}).values():
        assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in env


def test_ray_token_auth_is_on_by_default_in_every_ray_container_and_the_raycluster():
    rayservice = one(manifests(), "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    envs = _ray_container_envs(None)
    assert sorted(envs) == ["gpu", "head"]
    for env in envs.values():
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}
        # No Secret named: KubeRay generates the token and adds RAY_AUTH_TOKEN to every container.
        assert "RAY_AUTH_TOKEN" not in env


def test_a_named_token_secret_reaches_every_ray_container_of_every_worker_group():
    values = VALUE_SETS["autoscaling-two-gpu-types"]
    rayservice = one(manifests(values), "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "kvmesh-ray-token"}
    envs = _ray_container_envs(values)
    assert sorted(envs) == ["gpu", "h200", "head"]  # "spare" is disabled
    for env in envs.values():
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "kvmesh-ray-token", "key": "auth_token"}}
    assert "kvmesh-ray-token" not in rayservice["spec"]["serveConfigV2"]


def test_ray_token_auth_turned_off_says_so_everywhere():
    rayservice = one(manifests({"rayAuth": {"mode": "disabled"}}), "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "disabled"}
    for env in _ray_container_envs({"rayAuth": {"mode": "disabled"}}).values():
        assert env["RAY_AUTH_MODE"]["value"] == "disabled" and "RAY_AUTH_TOKEN" not in env
    assert "Ray's token authentication is OFF" in render({"rayAuth": {"mode": "disabled"}})["kvmesh/templates/NOTES.txt"]


def test_every_ray_container_caps_serve_grpc_messages():
    for env in _ray_container_envs(None).values():
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]["value"] == str(4 * 1024 * 1024)
    for env in _ray_container_envs(VALUE_SETS["cpu-only"]).values():
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]["value"] == "1048576"


@pytest.mark.parametrize("proxy_bytes", [1024, 1048576, 4 * 1024 * 1024, 64 * 1024 * 1024, 2**31 - 1])
def test_every_ray_container_lets_what_the_grpc_proxy_accepts_through_to_the_replica(proxy_bytes):
    """The proxy-to-replica limit is the one `kvmesh serve` sets for the same proxy limit (never
    below it), so a message above Ray's 4 MiB replica default that the proxy takes is not refused
    on its way to the ingress."""
    envs = _ray_container_envs({"serve": {"grpcMaxMessageBytes": proxy_bytes}})
    local = launcher.listener_env(serving.parse_config({"server": {"grpc_max_message_bytes": proxy_bytes}}))
    for env in envs.values():
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]["value"] == str(proxy_bytes)
        replica = env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]["value"]
        assert replica == local["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]
        assert int(replica) >= proxy_bytes


def test_a_group_env_may_not_set_the_replica_grpc_limit_apart_from_the_proxys():
    values = {"head": {"env": [{"name": "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", "value": "1024"}]}}
    with pytest.raises(helm.HelmError) as error:
        render(values)
    assert ("head.env sets RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH, which the chart sets on every "
            "Ray container from serve.grpcMaxMessageBytes") in str(error.value)


def test_ray_start_params_are_strings():
    spec = one(manifests(VALUE_SETS["cpu-only"]), "RayService")["spec"]["rayClusterConfig"]
    [group] = spec["workerGroupSpecs"]
    assert group["rayStartParams"] == {"metrics-export-port": "8080", "num-cpus": "2",
                                       "resources": '"{\\"kvmesh_worker\\": 1}"'}
    [container] = group["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_services_select_serving_pods_of_this_release_by_named_ports():
    objects = manifests(VALUE_SETS["names-and-ports"])
    http = one(objects, "Service", "llm-http")
    grpc = one(objects, "Service", "llm-grpc")
    for service, port, target in ((http, 80, "serve"), (grpc, 443, "grpc")):
        assert service["spec"]["selector"] == {"app.kubernetes.io/instance": "demo",
                                               "app.kubernetes.io/part-of": "kvmesh", "ray.io/serve": "true"}
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, target)]
        assert service["metadata"]["labels"]["team"] == "inference"
    rayservice = one(objects, "RayService")
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert (ports["serve"], ports["grpc"]) == (8100, 9100)
    assert head["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvmesh"
    assert head["spec"]["containers"][0]["image"] == "registry.example.com/kvmesh:0.1.0-cu130"
    assert head["spec"]["serviceAccountName"] == "kvmesh"
    config = serve_config(rayservice)
    assert (config["http_options"]["port"], config["grpc_options"]["port"]) == (8100, 9100)


def test_grpc_off_renders_no_grpc_service_or_port():
    objects = manifests(VALUE_SETS["cpu-only"])
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Service"] == ["demo-kvmesh-http"]
    rayservice = one(objects, "RayService")
    assert "grpc_options" not in serve_config(rayservice)
    assert serve_config(rayservice)["proxy_location"] == "HeadOnly"
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "grpc" not in [p["name"] for p in head["ports"]]


def test_service_monitor_scrapes_kvmesh_metrics_once_and_ray_metrics_from_every_pod():
    objects = manifests(VALUE_SETS["autoscaling-two-gpu-types"])
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("kvmesh-metrics", "/metrics"),
                                                                            ("ray-metrics", "/metrics")]
    assert "authorization" not in monitor["spec"]["endpoints"][0]  # /metrics is open by default
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # kvmesh_* through the head pod's proxy alone: one target, so a series is not summed per pod.
    kvmesh_service = one(objects, "Service", "-kvmesh-metrics")
    assert kvmesh_service["spec"]["selector"] == {"app.kubernetes.io/instance": "demo",
                                                  "app.kubernetes.io/part-of": "kvmesh",
                                                  "app.kubernetes.io/component": "head"}
    assert [(p["name"], p["targetPort"]) for p in kvmesh_service["spec"]["ports"]] == [("kvmesh-metrics", "serve")]
    ray_service = one(objects, "Service", "-ray-metrics")
    assert ray_service["spec"]["clusterIP"] == "None"
    # Exactly the two metrics Services carry the components the monitor selects, with the ports it names.
    [components] = [e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]
                    if e["key"] == "app.kubernetes.io/component"]
    selected = [o for o in objects if o["kind"] == "Service"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] in components]
    assert sorted((o["metadata"]["name"], o["spec"]["ports"][0]["name"]) for o in selected) == [
        ("demo-kvmesh-kvmesh-metrics", "kvmesh-metrics"), ("demo-kvmesh-ray-metrics", "ray-metrics")]
    head = one(objects, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert head["metadata"]["labels"]["app.kubernetes.io/component"] == "head"


def test_grafana_dashboard_configmap_holds_the_deploy_dashboard():
    objects = manifests(VALUE_SETS["autoscaling-two-gpu-types"])
    configmap = one(objects, "ConfigMap", "-dashboard")
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((REPO / "deploy" / "grafana" / "kvmesh.json").read_text())
    assert json.loads(configmap["data"]["kvmesh.json"]) == shipped


def test_chart_dashboard_copy_is_identical_to_deploy_grafana():
    # Helm reads files only inside the chart, so the chart carries a copy; it must not drift.
    assert (CHART / "dashboards" / "kvmesh.json").read_bytes() == (REPO / "deploy/grafana/kvmesh.json").read_bytes()


def test_notes_say_how_to_reach_the_api():
    notes = render(VALUE_SETS["autoscaling-two-gpu-types"])["kvmesh/templates/NOTES.txt"]
    assert "kubectl -n llm get rayservice demo-kvmesh" in notes
    assert "get svc demo-kvmesh-http -o jsonpath='{.status.loadBalancer.ingress[0].ip}'" in notes
    assert "$KVMESH_URL/v1/chat/completions" in notes
    assert "Service demo-kvmesh-grpc, port 9000" in notes
    assert "2-12 worker replicas, kv_pressure autoscaling" in notes
    assert "kubectl -n llm get secret kvmesh-ray-token -o jsonpath='{.data.auth_token}' | base64 -d" in notes
    default_notes = render()["kvmesh/templates/NOTES.txt"]
    assert "port-forward svc/demo-kvmesh-http 8000:8000" in default_notes
    # The token KubeRay generated for the RayService's active cluster.
    assert ("get secret $(kubectl -n llm get rayservice demo-kvmesh -o jsonpath="
            "'{.status.activeServiceStatus.rayClusterName}') -o jsonpath='{.data.auth_token}'") in default_notes


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_fail_with_a_message_naming_the_problem(case):
    values, message = BAD_VALUES[case]
    with pytest.raises(helm.HelmError) as error:
        render(values)
    assert message in str(error.value)


def test_bad_values_also_fail_lint():
    values, message = BAD_VALUES["replicas-not-a-number"]
    report = helm.lint(CHART, values, strict=True)
    assert any(message in error for error in report["errors"]), report


def test_every_value_is_documented_in_kuberay_style():
    """Each leaf key in values.yaml (and each map of them) has a `# --` comment above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("- ") or ":" not in stripped:
            continue
        key, _, value = stripped.partition(":")
        is_section = value.strip() == "" and index + 1 < len(lines) and _indent(lines[index + 1]) > _indent(line) \
            and not lines[index + 1].strip().startswith("- ")
        if is_section or _inside_value(lines, index):
            continue
        above = index - 1
        while above >= 0 and lines[above].strip().startswith("#") and not lines[above].strip().startswith("# --"):
            above -= 1
        if above < 0 or not lines[above].strip().startswith("# --"):
            undocumented.append(f"line {index + 1}: {key}")
    assert undocumented == []


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _inside_value(lines: list[str], index: int) -> bool:
    """True for keys nested inside a documented value (e.g. resources.requests.cpu)."""
    own = _indent(lines[index])
    for above in range(index - 1, -1, -1):
        line = lines[above]
        if not line.strip() or line.strip().startswith("#"):
            continue
        if _indent(line) < own:
            parent_doc = above - 1
            while parent_doc >= 0 and lines[parent_doc].strip().startswith("#") \
                    and not lines[parent_doc].strip().startswith("# --"):
                parent_doc -= 1
            return parent_doc >= 0 and lines[parent_doc].strip().startswith("# --") or _inside_value(lines, above)
    return False


def test_values_yaml_defaults_match_the_schema_and_the_serving_config_defaults():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
    assert values["kvmesh"]["engine"]["max_model_len"] is None
    assert values["kvmesh"]["autoscaling"]["policy"] in ("ongoing_requests", "queue", "kv_pressure",
                                                        "ttft_slo", "itl_slo")


def test_serve_config_v2_is_what_kvmesh_serve_emits_for_the_same_config():
    """Helm and `kvmesh serve --emit-serve-config` deploy the same thing from deploy/serve.yaml."""
    try:
        app = importlib.import_module("kvmesh.cluster.app")
    except ModuleNotFoundError as error:
        pytest.skip(f"kvmesh.cluster.app cannot be imported ({error}): nothing to compare with")
    serve_yaml = REPO / "deploy" / "serve.yaml"
    if not serve_yaml.is_file():
        pytest.skip("deploy/serve.yaml is not there yet")
    config = serving.load_config(str(serve_yaml))
    emitted = app.serve_config_document(config)
    gpu_pods = math.ceil(config.replicas.num_replicas * config.replicas.num_gpus)  # the chart checks they fit
    values = {"kvmesh": config.to_dict(), "worker": {"replicas": gpu_pods, "maxReplicas": max(gpu_pods, 4)}}
    rendered = serve_config(one(manifests(values), "RayService"))
    # Helm drops null keys and YAML turns 1.0 into 1: compare the configs as the app parses them.
    for document in (emitted, rendered):
        for application in document["applications"]:
            application["args"] = serving.parse_config(application["args"]).to_dict()
    assert rendered == emitted


def test_every_ray_container_runs_kvmeshs_worker_hook_with_the_server_settings():
    from kvmesh.cluster.ray_patches import NODE_ENV

    values = {"kvmesh": {"server": {"host": "::", "max_header_bytes": 32768, "header_timeout_s": 5.0,
                                    "stream_idle_timeout_s": 12.5}}}
    for env in _ray_container_envs(values).values():
        for name, value in NODE_ENV.items():
            assert env[name]["value"] == value
        assert env["KVMESH_LISTEN_HOST"]["value"] == "::"
        assert env["KVMESH_MAX_HEADER_BYTES"]["value"] == "32768"
        assert float(env["KVMESH_HEADER_TIMEOUT_S"]["value"]) == 5.0
        assert float(env["KVMESH_STREAM_IDLE_TIMEOUT_S"]["value"]) == 12.5
    for env in _ray_container_envs(None).values():  # the defaults: the serving config's
        assert env["KVMESH_LISTEN_HOST"]["value"] == "0.0.0.0"
        assert env["KVMESH_MAX_HEADER_BYTES"]["value"] == "65536"
        assert float(env["KVMESH_STREAM_IDLE_TIMEOUT_S"]["value"]) == 30.0


def test_the_grpc_message_limit_is_set_once_by_serve_grpc_max_message_bytes():
    """DEPLOY.md: Helm's serve.grpcMaxMessageBytes is the gRPC limit. The served config carries the
    same value, and a kvmesh.server.grpc_max_message_bytes that differs (which the pods would not
    apply) is refused naming both; an equal one is taken."""
    rayservice = one(manifests({"serve": {"grpcMaxMessageBytes": 1048576}}), "RayService")
    [app] = serve_config(rayservice)["applications"]
    assert app["args"]["server"]["grpc_max_message_bytes"] == 1048576
    with pytest.raises(helm.HelmError) as error:
        render({"kvmesh": {"server": {"grpc_max_message_bytes": 1048576}}})
    assert ("kvmesh.server.grpc_max_message_bytes (1048576) differs from serve.grpcMaxMessageBytes "
            "(4194304)") in str(error.value)
    render({"kvmesh": {"server": {"grpc_max_message_bytes": 1048576}}, "serve": {"grpcMaxMessageBytes": 1048576}})


def test_the_upgrade_strategy_value_sets_the_rayservice_s_and_is_checked():
    """DEPLOY.md: rayService.upgradeStrategy (NewCluster by default; None keeps the cluster)."""
    spec = one(manifests({"rayService": {"upgradeStrategy": "None"}}), "RayService")["spec"]
    assert spec["upgradeStrategy"] == {"type": "None"}
    with pytest.raises(helm.HelmError) as error:
        render({"rayService": {"upgradeStrategy": "Foo"}})
    assert "/rayService/upgradeStrategy" in str(error.value)
