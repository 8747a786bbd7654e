"""Real checkpoint layouts of each supported family, made by transformers (random init,
`save_pretrained` with a small `max_shard_size`, so sharded with `model.safetensors.index.json`):
the engine loads them and its prompt log-probabilities and greedy tokens equal transformers' own
model loaded from the same directory. And a config the decoder cannot run fails naming the field."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvmesh import LLM, SamplingParams
from kvmesh.worker.presets import build_byte_tokenizer
from tests.unit.reference import hf_greedy

TOLERANCE = 2e-4  # float32 on the CPU, as tests/unit/test_prompt_logprobs.py
MAX_NEW = 16
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             bos_token_id=256, eos_token_id=258, pad_token_id=256)

# Each family's distinguishing config fields, as their published config.json files set them.
FAMILIES = {
    # Llama 3.1 / 3.3: llama3 RoPE scaling, untied lm_head, several EOS ids
    "llama3.1": dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                     tie_word_embeddings=False, eos_token_id=[258, 257],
                     rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=64)),
    # Llama 3.2 1B / 3B: the same with tied embeddings
    "llama3.2": dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                     tie_word_embeddings=True,
                     rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=64)),
    # Qwen2.5 0.5B-3B: q/k/v biases, tied; sliding_window present but off
    "qwen2.5": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6,
                    tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                    rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # Qwen2.5 7B+: untied, and YaRN for long context
    "qwen2.5-yarn": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6,
                         tie_word_embeddings=False,
                         rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                                              original_max_position_embeddings=512)),
    # Qwen3 dense: q/k RMSNorm, explicit head_dim, tied (0.6B-4B)
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], rms_norm_eps=1e-6, head_dim=32,
                  tie_word_embeddings=True, attention_bias=False,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # Qwen3-MoE (30B-A3B / 235B-A22B): experts stored one tensor each, renormalised top-k
    "qwen3-moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], rms_norm_eps=1e-6,
                      head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[],
                      rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # the family's other switches: a dense layer among sparse ones, no renormalisation
    "qwen3-moe-mixed": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=16,
                            num_hidden_layers=3, tie_word_embeddings=False, num_experts=6,
                            num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
                            decoder_sparse_step=1, mlp_only_layers=[1]),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], rms_norm_eps=1e-5,
                    tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=48, sliding_window=None),
}


def family_config(family: str):
    kwargs = dict(SMALL, **FAMILIES[family])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def save_checkpoint(path, hf_config, seed: int = 5, max_shard_size: str = "40KB"):
    """A transformers model with every weight random (it zeroes some at init), saved sharded."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.05)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    build_byte_tokenizer(hf_config.vocab_size).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


PROMPTS = ["The quick brown fox jumps over the lazy dog", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_checkpoint_matches_transformers(tmp_path, family):
    reference = save_checkpoint(tmp_path, family_config(family))
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2, "the checkpoint is sharded"
    llm = LLM(str(tmp_path), device="cpu")
    prompts = [llm.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        max_tokens=MAX_NEW, temperature=0, prompt_logprobs=0))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, :-1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        got = torch.tensor(out.prompt_logprobs.logprobs[1:])
        assert torch.allclose(got, expected, atol=TOLERANCE), (got - expected).abs().max()
        assert out.token_ids == hf_greedy(reference, ids, MAX_NEW)


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5-yarn"])
def test_hub_style_config_with_rope_scaling_and_rope_theta_loads_the_same(tmp_path, family):
    """Published config.json files (written before transformers 5) keep RoPE in `rope_theta` and
    `rope_scaling`; transformers 5 saves `rope_parameters`. Both give the same model."""
    reference = save_checkpoint(tmp_path, family_config(family))
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), device="cpu")
    ids = llm.encode(PROMPTS[0])
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(out.prompt_logprobs.logprobs[1:]), expected, atol=TOLERANCE)


def test_every_eos_id_of_a_llama3_config_is_one_of_the_engines(tmp_path):
    save_checkpoint(tmp_path, family_config("llama3.1"))
    llm = LLM(str(tmp_path), device="cpu")
    assert {257, 258} <= set(llm.engine.eos_token_ids)


def test_a_shard_named_in_the_index_but_absent_fails_naming_it(tmp_path):
    save_checkpoint(tmp_path, family_config("qwen3"))
    shard = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"shard\(s\) listed in .*model.safetensors.index.json are "
                                         rf"missing from .*: {shard.name}; download the whole checkpoint"):
        LLM(str(tmp_path), device="cpu")


def test_files_beside_the_shards_that_the_index_does_not_name_are_not_read(tmp_path):
    save_checkpoint(tmp_path, family_config("qwen3"))
    (tmp_path / "consolidated.safetensors").write_bytes(b"not a safetensors file")
    LLM(str(tmp_path), device="cpu")  # reading it would fail


def test_a_missing_expert_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_checkpoint(tmp_path, family_config("qwen3-moe"), max_shard_size="10MB")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 expert weights, e.g. "
                                         r"\['model.layers.1.mlp.experts.5.up_proj.weight'\]"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("family,field,value,message", [
    ("llama3.1", "rope_parameters", dict(rope_type="longrope2", rope_theta=1e4),
     r"config.json rope_scaling.rope_type \(rope_parameters.rope_type\) 'longrope2' is not supported "
     r"\(unknown rope type\); "
     r"supported: default, linear, llama3, longrope, proportional, yarn"),
    ("llama3.1", "rope_parameters", dict(rope_type="dynamic", rope_theta=1e4, factor=2.0),
     r"rope_parameters.rope_type\) 'dynamic' is not supported \(its frequencies depend on the sequence length\)"),
    ("llama3.2", "hidden_act", "gelu", r"config.json hidden_act='gelu' is not supported"),
    ("llama3.2", "mlp_bias", True, r"config.json mlp_bias=True is not supported"),
    ("qwen3", "attention_bias", True, r"config.json attention_bias=True is not supported"),
    ("qwen2.5", "use_sliding_window", True, r"config.json use_sliding_window=True is not supported"),
    ("mixtral", "sliding_window", 256, r"config.json sliding_window=256 is not supported"),
])
def test_an_unsupported_config_fails_naming_the_field(tmp_path, family, field, value, message):
    hf_config = family_config(family)
    setattr(hf_config, field, value)
    hf_config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config check fails first
    build_byte_tokenizer(hf_config.vocab_size).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device="cpu")
