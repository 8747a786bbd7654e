"""The serving config: defaults, validation (unknown keys and bad values named), every field
documented, the engine config it yields, and deploy/serve.yaml."""

import os
import subprocess
import sys

import pytest
import yaml

from kvmesh.config import EngineConfig
from kvmesh.serve_config import ServeConfig, describe_fields, load_config, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_match_the_contract():
    cfg = ServeConfig().to_dict()
    assert cfg["model"] == "smollm2-135m-instruct"
    assert cfg["engine"] == {
        "device": "auto", "dtype": "auto", "block_size": 16, "max_num_batched_tokens": 2048,
        "max_num_seqs": 64, "max_model_len": None, "kv_cache_memory_bytes": None,
        "gpu_memory_utilization": 0.9, "enable_prefix_caching": True, "attention_backend": "auto",
        "kv_cache_dtype": "auto", "enforce_eager": False, "torch_compile": False, "seed": 0,
        "tensor_parallel_size": 1, "quantization": None, "scheduling_policy": "fcfs"}
    assert cfg["replicas"] == {
        "num_replicas": 1, "num_gpus": 1, "num_cpus": 1, "max_ongoing_requests": 64,
        "max_queued_requests": 1024, "engine_process": True, "resources": {},
        "engine_stall_timeout_s": 3.0}  # docs/RELIABILITY.md, docs/SERVING.md: stalled after 3 s
    assert cfg["routing"]["policy"] == "kv_events" and cfg["routing"]["ingress_replicas"] == 1
    assert cfg["autoscaling"] == {
        "enabled": False, "policy": "ongoing_requests", "min_replicas": 1, "max_replicas": 4,
        "upscale_delay_s": 5, "downscale_delay_s": 30, "downscale_to_zero_delay_s": None,
        "upscaling_factor": 1.0, "downscaling_factor": 1.0, "aggregation_function": "mean",
        "target_ongoing_requests": 8, "kv_free_threshold": 0.1, "ttft_p90_target_s": 1.0,
        "itl_p90_target_s": 0.1, "window_s": 30}
    assert cfg["server"] == {"host": "127.0.0.1", "http_port": 8000, "stream_interval": 1, "grpc_port": 9000, "direct_http_port": 0, "api_keys": [],
                             "auth_health": False, "auth_metrics": False,
                             "special_tokens_in_content": False, "trust_request_chat_template": False,
                             "reasoning_parser": None, "structured_outputs_in_reasoning": False, "api_docs": False,
                             "stream_idle_timeout_s": 30.0,
                             "max_header_bytes": 65_536, "header_timeout_s": 10.0,
                             "keep_alive_timeout_s": 90, "grpc_max_message_bytes": 4_194_304,
                             "grpc_reflection": False, "responses_store": 0}
    assert cfg["limits"] == {"max_prompt_tokens": None, "max_output_tokens": None,
                             "max_body_bytes": 1_048_576, "max_prompt_chars": None}


def test_a_silent_worker_is_stale_after_3_s_unless_kvmesh_stale_load_s_says_otherwise():
    """docs/ROUTING.md and docs/RELIABILITY.md: a worker whose load reports have not changed for
    KVMESH_STALE_LOAD_S (3 s) is ranked last. Read when router/routing_state.py is imported, so each
    case runs in a fresh interpreter."""
    script = ("from kvmesh.router.routing_state import RoutingState\n"
              "print(RoutingState('round_robin', block_size=16).stale_load_s)")

    def stale_load_s(**env):
        clean = {k: v for k, v in os.environ.items() if k != "KVMESH_STALE_LOAD_S"}
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**clean, **env},
                             capture_output=True, text=True, timeout=120, check=True).stdout
        return float(out)

    assert stale_load_s() == 3.0
    assert stale_load_s(KVMESH_STALE_LOAD_S="7.5") == 7.5


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"unknown key 'engine\.blok_size'"):
        parse_config({"engine": {"blok_size": 32}})
    with pytest.raises(ValueError, match=r"unknown key 'replica'"):
        parse_config({"replica": {}})


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"engine\.block_size"):
        parse_config({"engine": {"block_size": 0}})
    with pytest.raises(ValueError, match=r"routing\.policy"):
        parse_config({"routing": {"policy": "random"}})
    with pytest.raises(ValueError, match=r"server\.http_port"):
        parse_config({"server": {"http_port": 70000}})
    # slower than the idle heartbeat, a worker's reports would stop changing past the stale limit
    with pytest.raises(ValueError, match=r"routing\.load_report_interval_s: Input should be less than or equal to 1"):
        parse_config({"routing": {"load_report_interval_s": 3}})
    with pytest.raises(ValueError, match=r"min_replicas \(5\) must be <= autoscaling\.max_replicas \(2\)"):
        parse_config({"autoscaling": {"min_replicas": 5, "max_replicas": 2}})


@pytest.mark.parametrize("field, value", [
    ("upscaling_factor", 0), ("upscaling_factor", 11), ("downscaling_factor", 0),
    ("downscaling_factor", 1.5), ("aggregation_function", "median"),
    ("downscale_to_zero_delay_s", -1), ("kv_free_threshold", 1.0), ("itl_p90_target_s", 0),
    ("policy", "queue_length")])
def test_bad_autoscaling_knobs_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"autoscaling\.{field}"):
        parse_config({"autoscaling": {field: value}})


def test_every_field_is_documented():
    fields = describe_fields()
    assert len(fields) > 40
    assert [name for name, doc in fields if len(doc) < 10] == []


def test_engine_config_carries_every_engine_field_and_the_worker_id():
    cfg = parse_config({"model": "random:tiny-llama", "engine": {"block_size": 32, "max_num_seqs": 8,
                                                                 "device": "cpu"}})
    engine = cfg.engine_config(worker_id="abc")
    assert isinstance(engine, EngineConfig)
    assert (engine.model, engine.block_size, engine.max_num_seqs, engine.device, engine.worker_id) == (
        "random:tiny-llama", 32, 8, "cpu", "abc")
    assert set(cfg.engine.model_dump()) <= set(EngineConfig.field_names())


def test_load_config_reads_yaml_and_names_the_file_in_errors(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("model: random:tiny-llama\nreplicas: {num_replicas: 2, num_gpus: 0}\n")
    assert load_config(str(good)).replicas.num_replicas == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: {polcy: kv_events}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: .*unknown key 'routing\.polcy'"):
        load_config(str(bad))
    not_a_map = tmp_path / "list.yaml"
    not_a_map.write_text("- 1\n")
    with pytest.raises(ValueError, match="must be a YAML mapping"):
        load_config(str(not_a_map))


def serve_args(*argv):
    """`kvmesh serve ARGV` as the CLI's own parser reads it."""
    from kvmesh.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_device_cpu_also_asks_for_no_gpus_per_replica(tmp_path):
    """docs/SERVING.md, README: `--device cpu` also sets replicas.num_gpus: 0 (a CPU replica must not
    wait for a GPU); other devices keep the config's GPUs."""
    from kvmesh.commands.serve import load_with_overrides

    path = tmp_path / "gpu.yaml"
    path.write_text("model: random:tiny-llama\nreplicas: {num_replicas: 2, num_gpus: 1}\n")
    cfg = load_with_overrides(serve_args(str(path), "--device", "cpu"))
    assert (cfg.engine.device, cfg.replicas.num_gpus) == ("cpu", 0)
    assert (cfg.model, cfg.replicas.num_replicas) == ("random:tiny-llama", 2)  # the rest kept
    for device in ("cuda", "auto"):
        cfg = load_with_overrides(serve_args(str(path), "--device", device))
        assert (cfg.engine.device, cfg.replicas.num_gpus) == (device, 1)
    assert load_with_overrides(serve_args("--device", "cpu")).replicas.num_gpus == 0  # no config


def test_repeated_api_key_flags_are_added_to_the_configs_keys(tmp_path):
    from kvmesh.commands.serve import load_with_overrides

    path = tmp_path / "keys.yaml"
    path.write_text("server: {api_keys: [from-file]}\n")
    cfg = load_with_overrides(serve_args(str(path), "--api-key", "one", "--api-key", "two",
                                         "--api-key", "from-file"))
    assert cfg.server.api_keys == ["from-file", "one", "two"]
    assert load_with_overrides(serve_args("--api-key", "a", "--api-key", "b")).server.api_keys == ["a", "b"]


def test_emit_serve_config_writes_the_serve_config_to_path_and_exits(tmp_path, capsys):
    """`--emit-serve-config PATH` writes the Serve config of the config with the command line's
    overrides to PATH and returns without starting anything; without PATH it goes to stdout."""
    from kvmesh.cluster.app import serve_config_document
    from kvmesh.commands.serve import load_with_overrides, run_serve

    out = tmp_path / "app.yaml"
    argv = ("--model", "random:tiny-llama", "--device", "cpu", "--http-port", "8100",
            "--api-key", "k1", "--emit-serve-config", str(out))
    assert run_serve(serve_args(*argv)) == 0
    written = yaml.safe_load(out.read_text())
    assert written == serve_config_document(load_with_overrides(serve_args(*argv)))
    args = written["applications"][0]["args"]
    assert (args["model"], args["replicas"]["num_gpus"], args["server"]["api_keys"]) == (
        "random:tiny-llama", 0, ["k1"])
    assert written["http_options"]["port"] == 8100
    assert f"wrote {out}" in capsys.readouterr().err

    assert run_serve(serve_args("--model", "random:tiny-llama", "--emit-serve-config")) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["applications"][0]["args"]["model"] == "random:tiny-llama"


def test_shipped_deploy_serve_yaml_is_valid_and_complete():
    path = os.path.join(REPO, "deploy", "serve.yaml")
    cfg = load_config(path)
    with open(path) as f:
        raw = yaml.safe_load(f)
    # complete: every section and every field is spelled out, not left to defaults
    for section in ("engine", "replicas", "routing", "autoscaling", "server"):
        assert set(raw[section]) == set(getattr(cfg, section).model_dump()), section
    assert cfg.replicas.num_gpus == 1


def test_emitted_serve_config_imports_build_app_with_the_config_as_args():
    from kvmesh.cluster.app import serve_config_document

    cfg = parse_config({"model": "random:tiny-llama", "server": {"http_port": 8100, "grpc_port": 9100}})
    doc = serve_config_document(cfg)
    app = doc["applications"][0]
    assert app["import_path"] == "kvmesh.cluster.app:build_app"
    assert app["args"] == cfg.to_dict()
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8100, "keep_alive_timeout_s": 90}
    assert doc["grpc_options"]["port"] == 9100
    assert "grpc_options" not in serve_config_document(parse_config({"server": {"grpc_port": 0}}))


def test_emitted_serve_config_is_accepted_by_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    from kvmesh.cluster.app import serve_config_document

    ServeDeploySchema.model_validate(serve_config_document(ServeConfig()))


def test_scales_to_zero_only_with_autoscaling_down_to_zero_replicas():
    from kvmesh.serve_config import parse_config
    assert parse_config({"autoscaling": {"enabled": True, "min_replicas": 0}}).scales_to_zero
    assert not parse_config({"autoscaling": {"enabled": True, "min_replicas": 1}}).scales_to_zero
    assert not parse_config({"autoscaling": {"enabled": False, "min_replicas": 0}}).scales_to_zero


@pytest.mark.parametrize("text, where, what", [
    ("routing: [\n", "line 2, column 1", "expected the node content"),
    ("a: b\n  c: d\n", "line 2, column 4", "mapping values are not allowed here"),
])
def test_a_config_that_is_not_yaml_is_one_line_naming_the_file_and_the_place(tmp_path, text, where, what):
    """Not the YAML parser's traceback: `kvmesh serve` prints it as `kvmesh serve: error: ...`."""
    from kvmesh.cli import main

    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(str(path))
    assert str(e.value).startswith(f"{path}: not valid YAML ({where}): {what}")
    assert main(["serve", str(path)]) == 2


def test_a_config_path_that_is_no_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.yaml: no such config file$"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ValueError, match=r"no such config file \(a directory\)"):
        load_config(str(tmp_path))
