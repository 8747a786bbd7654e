"""The three registries (routing policies, attention backends, model architectures): every other list
of names agrees with them, capabilities drive `auto` and CUDA graphs, unknown names are clear errors."""

import argparse
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from kvmesh import LLM
from kvmesh.cli import main
from kvmesh.config import ATTENTION_BACKENDS
from kvmesh.router import policies
from kvmesh.router.policies import DEFAULT_POLICY, POLICY_NAMES, policy_defaults
from kvmesh.serve_config import EngineSection, RoutingSection
from kvmesh.worker.attention import base, load_backend_class, registry, select_backend
from kvmesh.worker.attention.registry import BACKENDS, choose_backend, uses_cuda_graphs
from kvmesh.worker.models import MODELS, model_class_for
from kvmesh.worker.models.decoder import DecoderForCausalLM
from kvmesh.worker.presets import PRESETS, hf_config_for

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "helm/kvmesh/values.schema.json").read_text())["properties"]["kvmesh"]["properties"]
SIM_SMALL = ["--workers", "2", "--requests", "20", "--kv-blocks", "300", "--no-progress", "--json",
             "--workload-opt", "num_tenants=2", "--workload-opt", "system_tokens=64",
             "--workload-opt", "suffix_tokens=(16,32)", "--workload-opt", "output_tokens=(4,8)"]


def literal_values(model, field: str) -> set:
    return set(typing.get_args(model.model_fields[field].annotation))


# ---- routing policies --------------------------------------------------------------------------

def test_serve_config_and_helm_schema_name_exactly_the_registered_policies():
    assert literal_values(RoutingSection, "policy") == set(POLICY_NAMES)
    assert set(SCHEMA["routing"]["properties"]["policy"]["enum"]) == set(POLICY_NAMES)
    assert RoutingSection().policy == DEFAULT_POLICY
    description = RoutingSection.model_fields["policy"].description
    assert all(name in description for name in POLICY_NAMES)


def test_sim_cli_takes_policy_names_from_the_registry(monkeypatch, capsys):
    monkeypatch.setitem(policies.POLICIES, "scratch_rr", policies.POLICIES["round_robin"])
    assert main(["sim", "--policy", "scratch_rr,kv_events", "--load", "0.5", *SIM_SMALL]) == 0
    assert list(json.loads(capsys.readouterr().out)["policies"]) == ["scratch_rr", "kv_events"]


def test_bench_serve_rejects_an_unknown_policy_before_launching_anything(capsys):
    assert main(["bench", "serve", "--launch=--device cpu", "--policies", "kv_events,nope",
                 "--rate", "1"]) == 2
    assert "unknown policy 'nope'; choose one of round_robin," in capsys.readouterr().err


def test_policy_defaults_are_the_constructor_options():
    assert policy_defaults("session") == {"virtual_nodes": 64}
    assert policy_defaults("round_robin") == {}
    kv_events = policy_defaults("kv_events")
    assert kv_events["temperature"] == 0.0 and "index" not in kv_events and "seed" not in kv_events
    assert kv_events["pending_requests"] == 4096  # docs/ROUTING.md: the last 4,096 routed requests


def test_kv_events_cost_weights_are_the_documented_formula():
    """docs/ROUTING.md's cost formula and hysteresis, term by term."""
    from kvmesh.router.cost import CostWeights

    assert dataclasses.asdict(CostWeights()) == {
        "prefill": 2.0, "queued_prefill": 1.0, "running_decode": 0.05, "kv_pressure": 512.0,
        "outstanding": 256.0, "stay_margin": 8192.0, "stay_min_cached": 0.5, "in_flight": 1.0}


# ---- attention backends ------------------------------------------------------------------------

def installed_everywhere(monkeypatch):
    """The registry as on a GPU machine with every backend's library installed."""
    monkeypatch.setattr(registry, "BACKENDS",
                        {n: dataclasses.replace(s, library=None) for n, s in BACKENDS.items()})


def test_engine_config_helm_schema_and_benches_name_exactly_the_registered_backends():
    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS}
    assert literal_values(EngineSection, "attention_backend") == {"auto", *BACKENDS}
    assert set(SCHEMA["engine"]["properties"]["attention_backend"]["enum"]) == {"auto", *BACKENDS}
    for name in BACKENDS:  # each line names a class that knows its key (the check in base reads it)
        cls = load_backend_class(name)
        assert issubclass(cls, base.AttentionBackend) and cls.name == name


@pytest.mark.parametrize("block_size,head_dim,dtype,expected", [
    (16, 128, "bfloat16", "flashinfer"),
    (256, 96, "bfloat16", "flash_attn"),  # flashinfer: no head_dim 96
    (16, 96, "bfloat16", "torch"),  # flash_attn needs pages of 256; triton a power-of-two head_dim
    (16, 128, "float32", "triton"),  # flashinfer and flash_attn take half precision only
])
def test_auto_takes_the_first_backend_whose_capabilities_fit(monkeypatch, block_size, head_dim, dtype, expected):
    installed_everywhere(monkeypatch)
    assert choose_backend("auto", "cuda", block_size, head_dim, dtype) == expected
    assert choose_backend("auto", "cpu", block_size, head_dim, dtype) == "torch"


def test_auto_skips_backends_whose_library_is_not_installed(monkeypatch):
    # as on a machine without flashinfer, flash-attn or triton (triton now comes with xgrammar on
    # x86-64 Linux, so the CPU machine is no longer such a machine)
    monkeypatch.setattr(registry, "BACKENDS", {
        n: dataclasses.replace(s, library=s.library and "kvmesh_not_installed_" + s.library)
        for n, s in BACKENDS.items()})
    assert choose_backend("auto", "cuda", 16, 128, "bfloat16") == "torch"


def test_cuda_graphs_follow_the_backend_capability(monkeypatch):
    assert uses_cuda_graphs("triton", "cuda", enforce_eager=False)
    assert not uses_cuda_graphs("torch", "cuda", enforce_eager=False)
    assert not uses_cuda_graphs("triton", "cuda", enforce_eager=True)
    assert not uses_cuda_graphs("triton", "cpu", enforce_eager=False)
    monkeypatch.setitem(registry.BACKENDS, "torch", dataclasses.replace(BACKENDS["torch"], cuda_graphs=True))
    assert uses_cuda_graphs("torch", "cuda", enforce_eager=False)


def backends_taking(*request, but: str) -> list[str]:
    """The backends other than `but`, in registry order, that choose_backend accepts by name for
    (block_size, head_dim, dtype[, kv_cache_dtype]) on a GPU."""
    taking = []
    for name in registry.BACKENDS:
        try:
            choose_backend(name, "cuda", *request)
        except ValueError:
            continue
        if name != but:
            taking.append(name)
    return taking


def test_an_unsupported_combination_names_the_field_and_the_limit(monkeypatch):
    installed_everywhere(monkeypatch)
    takers = backends_taking(16, 128, "bfloat16", but="flash_attn")
    assert "torch" in takers  # the reference takes any block size, head dim and dtype
    with pytest.raises(ValueError, match=r"attention_backend 'flash_attn' needs block_size \(engine\.block_size "
                                         r"in a serve config\) to be a multiple of 256, got 16; change it or "
                                         rf"choose attention_backend {' or '.join(takers)}$"):
        select_backend("flash_attn", torch.device("cuda"), 16, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs the model's head_dim to be one of 64, 128, 256, got 96"):
        choose_backend("flashinfer", "cuda", 16, 96, "bfloat16")
    with pytest.raises(ValueError, match=r"needs dtype \(engine\.dtype in a serve config\) to be one of "
                                         r"bfloat16, float16, got float32"):
        choose_backend("flashinfer", "cuda", 16, 128, "float32")


@pytest.mark.parametrize("bench", ["offline", "latency"])
def test_the_benches_default_block_size_is_one_the_backend_takes(monkeypatch, bench):
    """Without --block-size, `kvmesh bench offline|latency` use 16 rounded up to the backend's
    block_size_multiple (registry.block_size_for): 256 for flash_attn, 16 for auto."""
    import kvmesh
    from kvmesh.bench import latency, offline

    installed_everywhere(monkeypatch)
    monkeypatch.setitem(registry.BACKENDS, "scratch_pages_of_48",
                        dataclasses.replace(BACKENDS["torch"], block_size_multiple=48))

    class Built(Exception):
        pass

    def fake_llm(**kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(kvmesh, "LLM", fake_llm)

    def block_size(backend, given=None):
        parser = argparse.ArgumentParser()
        (offline if bench == "offline" else latency).add_arguments(parser)
        args = parser.parse_args(["--block-size", str(given)] if given else [])
        args.attention_backend = backend  # a name the CLI's choices (kvmesh.config) may not list yet
        if bench == "offline":
            return offline.engine_args(args)["block_size"]
        with pytest.raises(Built) as built:
            latency.run(args)
        return built.value.args[0]["block_size"]

    assert block_size("auto") == 16 and block_size("flash_attn", given=512) == 512
    assert block_size("scratch_pages_of_48") == 48  # read from the registry, not from a list of names
    for name, spec in registry.BACKENDS.items():
        size = block_size(name)
        assert size >= 16 and size % spec.block_size_multiple == 0, (name, size)
        choose_backend(name, "cuda", size, 128, "bfloat16")  # the backend takes it


def test_a_backend_built_directly_is_checked_against_its_registry_line():
    triton_cls = load_backend_class("triton")  # the check runs before the class imports triton
    with pytest.raises(ValueError, match="needs the model's head_dim to be one of 16, 32, 64, 128, 256, got 96"):
        triton_cls(8, 2, 96, 16, 0.1, torch.device("cpu"), torch.bfloat16)


def test_unknown_missing_or_gpu_only_backends_are_clear_errors():
    with pytest.raises(ValueError, match=f"attention_backend must be one of auto, {', '.join(BACKENDS)}; "
                                         "got 'nope'"):
        choose_backend("nope", "cpu", 16, 64, "float32")
    with pytest.raises(ValueError, match="attention_backend 'flashinfer' is not available here: the "
                                         "'flashinfer' package is not installed"):
        choose_backend("flashinfer", "cuda", 16, 128, "bfloat16")
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        LLM("random:tiny-llama", device="cpu", attention_backend="triton")


# ---- model architectures -----------------------------------------------------------------------

def test_every_preset_builds_the_class_its_architecture_is_registered_with():
    for preset in PRESETS:
        hf_config = hf_config_for(preset)
        arch, cls = model_class_for(hf_config, preset)
        assert arch == hf_config.architectures[0] and issubclass(cls, DecoderForCausalLM)
        assert MODELS[arch].target.endswith(f":{cls.__name__}")
    llm = LLM("random:tiny-qwen3", device="cpu")
    assert type(llm.engine.model).__name__ == "Qwen3ForCausalLM"


def test_each_architecture_adapter_sets_its_switches():
    configs = {p: hf_config_for(p) for p in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")}
    switches = {}
    for preset, hf_config in configs.items():
        arch, cls = model_class_for(hf_config, preset)
        config = cls.config_from_hf(hf_config, preset, arch)
        switches[arch] = (config.qkv_bias, config.qk_norm)
    assert switches == {"LlamaForCausalLM": (False, False), "Qwen2ForCausalLM": (True, False),
                        "Qwen3ForCausalLM": (False, True)}


def test_a_config_without_architectures_is_looked_up_by_model_type():
    hf_config = hf_config_for("tiny-qwen2")
    hf_config.architectures = None
    assert model_class_for(hf_config, "x")[0] == "Qwen2ForCausalLM"


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path):
    assert "GPT2LMHeadModel" not in MODELS and all(e.model_type != "gpt2" for e in MODELS.values())
    AutoConfig.for_model("gpt2", architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the lookup fails first
    supported = ", ".join(MODELS)  # every registered architecture, in registry order
    assert "LlamaForCausalLM" in MODELS and "Qwen3ForCausalLM" in MODELS
    with pytest.raises(ValueError, match=r"architecture \['GPT2LMHeadModel'\] is not supported; "
                                         rf"supported: {re.escape(supported)}$"):
        LLM(str(tmp_path), device="cpu")
