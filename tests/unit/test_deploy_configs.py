"""The `ray up` cluster YAMLs in deploy/ pass Ray's own offline checks and deploy kvmesh as documented."""

import copy
import importlib
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CLOUD_CONFIGS = ["aws.yaml", "gcp.yaml"]
ALL_CONFIGS = CLOUD_CONFIGS + ["local-fake.yaml"]

ray_util = pytest.importorskip("ray.autoscaler._private.util", reason="ray is not installed (pip install -e '.[serve]')")


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


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
    assert any('pip install -e "$HOME/kvmesh[serve]"' in c for c in config["head_setup_commands"])
    assert any('pip install -e "$HOME/kvmesh[serve,gpu]"' in c for c in config["worker_setup_commands"])
    assert "**/.git" in config["rsync_exclude"]


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


def _ray_start_env(command: str) -> dict[str, str]:
    """The VAR=value assignments a `ray start` command line runs with."""
    words = shlex.split(command.replace(";", " ; "))
    start = words.index("ray")
    assert words[start + 1] == "start", command
    env_words = words[words.index(";") + 1:start]
    return dict(word.split("=", 1) for word in env_words)


def _ray_start_commands(config: dict) -> dict[str, str]:
    [head] = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    [worker] = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    return {"head": head, "worker": worker}


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_starts_ray_with_token_auth_from_the_mounted_token_file(name):
    config = prepared(name)
    token_path = "$HOME/.ray/auth_token"
    for role, command in _ray_start_commands(config).items():
        env = _ray_start_env(command)
        assert env["RAY_AUTH_MODE"] == "token", role
        assert env["RAY_AUTH_TOKEN_PATH"] == token_path, role
    # The token file: from the operator's machine to Ray's default token path on every node
    # (ray up copies file_mounts to the head, and the head's autoscaler to each worker).
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/kvmesh_auth_token"
    # ray exec / ray attach shells and the head's kvmesh serve (every command sources ~/.bashrc).
    export = f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_path}"
    for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
        assert any(f"echo '{export}' >> ~/.bashrc" in c for c in commands)


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_caps_serve_grpc_messages_and_runs_the_same_ray_environment(name):
    commands = _ray_start_commands(prepared(name))
    head_env, worker_env = (_ray_start_env(commands[role]) for role in ("head", "worker"))
    assert head_env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(4 * 1024 * 1024)
    assert head_env == worker_env
    assert head_env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    for command in commands.values():
        assert "--metrics-export-port=8080" in command and "--object-manager-port=8076" in command


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_the_dashboard_listens_on_the_heads_loopback_only(name):
    head = _ray_start_commands(prepared(name))["head"]
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
    serving = _serve_config()
    config = serving.load_config(str(serve_yaml))
    assert config.replicas.num_gpus >= 1  # one replica per GPU of the worker node types
    assert config.server.host == "0.0.0.0"  # reachable through `ray attach -p` and from other nodes


def test_local_fake_names_rays_fake_provider_and_a_worker_only_resource():
    config = prepared("local-fake.yaml")
    module_name, _, class_name = config["provider"]["module"].rpartition(".")
    provider = getattr(importlib.import_module(module_name), class_name)
    assert provider.__name__ == "FakeMultiNodeProvider"
    assert config["provider"]["use_node_id_as_ip"] is True
    types = config["available_node_types"]
    assert "kvmesh_worker" not in types[config["head_node_type"]]["resources"]
    assert types["ray.worker.cpu"]["resources"]["kvmesh_worker"] == 1
    assert "GPU" not in types["ray.worker.cpu"]["resources"]


def test_local_fake_serving_config_places_cpu_replicas_on_worker_nodes_only():
    config = _serve_config().load_config(str(DEPLOY / "local-fake-serve.yaml"))
    assert config.model == "random:tiny-llama"
    assert (config.replicas.num_gpus, config.engine.device) == (0, "cpu")
    assert config.replicas.resources == {"kvmesh_worker": 1.0}
    assert config.server.host == "127.0.0.1"
    cluster = load("local-fake.yaml")
    max_nodes = cluster["available_node_types"]["ray.worker.cpu"]["max_workers"]
    assert config.autoscaling.enabled and config.autoscaling.max_replicas <= max_nodes


def _serve_config():
    try:
        return importlib.import_module("kvmesh.serve_config")
    except ModuleNotFoundError as error:
        if error.name != "kvmesh.serve_config":
            raise
        pytest.skip("kvmesh.serve_config is not there yet")
