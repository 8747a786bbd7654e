"""`kvmesh serve` with a model it cannot serve says why in one line: before Ray starts when the
model names nothing loadable or an unsupported architecture (exit 2), and with the replica's own
exception when a deployment fails after Ray started (exit 1, the reason on the last line; Serve's
controller still logs the replica's traceback on the way), never the command's own traceback ending
in Serve's bare "Failed to update the deployments"; and it leaves no Ray process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kvmesh.cluster.local import free_port, loopback_ray_env

pytestmark = pytest.mark.starts_ray  # some of its `kvmesh serve` runs start Ray before they fail


def run_serve(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`kvmesh serve ARGS` in its own process group, to its end; afterwards no process of that group
    may remain (bounded wait, then the group is killed and the test fails)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--device", "cpu",
                             "--http-port", str(free_port()), "--grpc-port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or loopback_ray_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    left = group_members(proc.pid)
    for _ in range(60):
        if not left:
            break
        time.sleep(0.5)
        left = group_members(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def group_members(pgid: int) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(p.pid) == pgid:
                found.append(f"{p.pid} {p.info['name']}")
        except OSError:
            pass
    return found


@pytest.mark.parametrize("model, message", [
    ("/nonexistent/kvmesh-model", "model: '/nonexistent/kvmesh-model' is not a known model name"),
    ("random:no-such-preset", "model: unknown preset 'random:no-such-preset'"),
])
def test_a_model_that_names_nothing_is_refused_before_ray_starts(model, message):
    result = run_serve("--model", model, timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kvmesh serve: error: ") and message in last, result.stderr
    assert "Traceback" not in result.stderr and "ray" not in result.stdout.lower(), result.stderr


def test_an_unsupported_architecture_is_refused_before_ray_starts(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    result = run_serve("--model", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "architecture 'gpt2' is not supported; supported: LlamaForCausalLM" in last, result.stderr
    assert "Traceback" not in result.stderr


def test_a_reasoning_parser_whose_markers_the_tokenizer_lacks_is_refused_before_ray_starts():
    """docs/SERVING.md "Reasoning models": the default SmolLM2 has no <think> token."""
    result = run_serve("--reasoning-parser", "qwen3", timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert ("server.reasoning_parser: qwen3 reads <think> ... </think>, but this model's tokenizer "
            "has no single token for <think> or </think>") in last, result.stderr
    assert "Traceback" not in result.stderr and "ray" not in result.stdout.lower(), result.stderr


def tiny_llama_dir(path, tokenizer: bool):
    from transformers import LlamaConfig

    from kvmesh.worker.presets import build_byte_tokenizer

    LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=300, bos_token_id=1,
                eos_token_id=2).save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    if tokenizer:
        build_byte_tokenizer(300).save_pretrained(path)
    return path


def test_a_model_without_a_tokenizer_is_refused_before_ray_starts(tmp_path):
    result = run_serve("--model", str(tiny_llama_dir(tmp_path, tokenizer=False)), timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"model: {tmp_path} has no tokenizer (tokenizer.json or" in last, result.stderr


def test_a_config_field_the_engine_cannot_honour_is_refused_before_ray_starts(tmp_path):
    import json

    tiny_llama_dir(tmp_path, tokenizer=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    result = run_serve("--model", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "config.json hidden_act='gelu' is not supported (the MLP is SiLU-gated only)" in last, result.stderr


@pytest.mark.slow
def test_a_replica_that_fails_to_start_is_reported_with_its_exception(tmp_path):
    """A Llama checkpoint with a tokenizer but a weights file that is not safetensors passes the
    early check; its worker replica fails in its constructor. One try per replica (Serve's retry
    count lowered for the test) so the failure comes in seconds, not after three model loads."""
    tiny_llama_dir(tmp_path, tokenizer=True)
    env = loopback_ray_env()
    env["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"
    result = run_serve("--model", str(tmp_path), env=env, timeout=400)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kvmesh serve: the deployment failed: "), result.stderr
    # the replica's reason, after the deployment's name (the worker's weights, or the ingress's
    # tokenizer: whichever replica failed first)
    assert "KVWorker: " in last and "safetensors" in last.split("KVWorker: ", 1)[1].lower(), last
    # Serve's controller logs the replica's traceback on the way; the command's own is not there
    assert "kvmesh/cli.py" not in result.stderr and "launcher.py" not in result.stderr, result.stderr


def test_a_failure_before_serve_starts_is_reported_alone(tmp_path):
    """A deploy that fails after Ray started but before Serve did (here the ingress's import of
    grpc_health, missing as it was on the GPU machine once) ends in that exception, not in the
    shutdown's "There is no Serve instance running" chained after it; no process is left."""
    stub = tmp_path / "stub" / "grpc_health"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'grpc_health' (test stub)\")\n")
    env = loopback_ray_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(stub.parent), env.get("PYTHONPATH")) if p)
    result = run_serve("--model", "random:tiny-llama", env=env, timeout=200)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "ModuleNotFoundError: No module named 'grpc_health' (test stub)", result.stderr[-3000:]
    assert "There is no Serve instance" not in result.stderr, result.stderr[-3000:]
