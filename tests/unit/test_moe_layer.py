"""The mixture-of-experts layer (worker/layers/moe.py) and its architectures' config adapters: routing
equal to transformers' routers, the sparse layers a Qwen3-MoE config names, experts stored already
stacked, and the layer under torch.compile."""

import json
import math

import torch
from transformers import AutoConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from kvmesh import LLM, SamplingParams
from kvmesh.worker.layers.moe import SparseMoE
from kvmesh.worker.model_config import MoEConfig
from kvmesh.worker.models import model_class_for
from kvmesh.worker.presets import build_byte_tokenizer, hf_config_for


def check_routing(hf_router, norm_topk_prob: bool):
    moe = SparseMoE(MoEConfig(num_experts=8, num_experts_per_tok=3, expert_intermediate_size=4,
                              norm_topk_prob=norm_topk_prob, sparse_layers=(0,)), hidden_size=16)
    torch.manual_seed(0)
    hf_router.weight.data.normal_()
    moe.gate.weight.data.copy_(hf_router.weight.data)
    x = torch.randn(11, 16)
    _, hf_weights, hf_ids = hf_router(x)
    weights, ids = moe.route(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.to(weights.dtype), atol=0, rtol=0)


def test_routing_equals_qwen3_moe_router_with_and_without_renormalisation():
    for norm in (True, False):
        config = AutoConfig.for_model("qwen3_moe", hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                      norm_topk_prob=norm)
        check_routing(Qwen3MoeTopKRouter(config), norm)


def test_routing_equals_mixtral_router():
    config = AutoConfig.for_model("mixtral", hidden_size=16, num_local_experts=8, num_experts_per_tok=3)
    check_routing(MixtralTopKRouter(config), norm_topk_prob=True)


def test_qwen3_moe_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    hf_config = hf_config_for("tiny-qwen3-moe")
    hf_config.num_hidden_layers, hf_config.decoder_sparse_step, hf_config.mlp_only_layers = 6, 2, [3]
    arch, cls = model_class_for(hf_config, "x")
    config = cls.config_from_hf(hf_config, "x", arch)
    assert config.moe.sparse_layers == (1, 5) and config.qk_norm
    model = cls(config, 64)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MLP", "SparseMoE", "MLP", "MLP", "MLP", "SparseMoE"]


def test_experts_stored_stacked_load_as_stored_per_expert(tmp_path):
    """transformers 5 holds experts stacked (`mlp.experts.gate_up_proj`); a checkpoint saved that way
    loads too, and runs as the preset it was taken from."""
    from safetensors.torch import save_file

    preset = LLM("random:tiny-qwen3-moe", device="cpu")
    state = {k: v.contiguous() for k, v in preset.engine.model.hf_state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config_for("tiny-qwen3-moe").to_dict()))
    build_byte_tokenizer(512).save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    prompt = [[5, 6, 7, 8, 9, 10]]
    want = preset.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)[0]
    got = LLM(str(tmp_path), device="cpu").generate(prompt_token_ids=prompt, sampling_params=params,
                                                    use_tqdm=False)[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_compiled_moe_layers_give_the_uncompiled_tokens():
    prompts = [[(7 * j) % 500 + 3 for j in range(40)], [5, 6, 7]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    outs = [LLM("random:tiny-qwen3-moe", block_size=4, max_num_batched_tokens=32, torch_compile=compiled)
            .generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            for compiled in (False, True)]
    for want, got in zip(*outs):
        assert got.token_ids == want.token_ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got.logprobs, want.logprobs))
