"""The fused Triton MoE kernel (kvmesh.kernels.fused_moe) on the GPU: in bf16 at Qwen3-30B-A3B's and
a Mixtral-like width, no further from a float32 reference than the torch path in bf16 is; under a CUDA
graph the same as eager; and the MoE presets on the GPU (float32, CUDA graphs on) give transformers'
greedy tokens (up to near-ties: attention runs in TF32 there).

Run on the GPU machine from the repository root: python -m pytest -q -s tests/gpu/test_fused_moe_gpu.py"""

import gc

import pytest
import torch

from kvmesh.kernels.fused_moe import fused_moe
from kvmesh.worker.layers.moe import moe_reference

pytestmark = pytest.mark.gpu


def random_moe(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, device="cuda", generator=generator) / inter ** 0.5
    logits = torch.randn(tokens, experts, device="cuda", generator=generator)
    weights, expert_ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return [t.to(dtype) if t.is_floating_point() else t for t in (x, gate_up, down, weights)] + [expert_ids]


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 128, 8, 2048, 768),     # Qwen3-30B-A3B: a decode token
    (8, 128, 8, 2048, 768),
    (256, 128, 8, 2048, 768),   # a decode batch of 256
    (3000, 128, 8, 2048, 768),  # a prefill chunk: many tokens per expert
    (100, 8, 2, 1024, 3584),    # Mixtral-like (narrower)
])
def test_bf16_kernel_is_as_close_to_float32_as_the_torch_path(tokens, experts, top_k, hidden, inter):
    x, gate_up, down, weights, expert_ids = random_moe(tokens, experts, top_k, hidden, inter, torch.bfloat16)
    exact = moe_reference(x.float(), gate_up.float(), down.float(), weights.float(), expert_ids)
    kernel_err = (fused_moe(x, gate_up, down, weights, expert_ids).float() - exact).abs()
    torch_err = (moe_reference(x, gate_up, down, weights, expert_ids).float() - exact).abs()
    print(f"max err kernel {kernel_err.max():.3e} torch {torch_err.max():.3e}; "
          f"mean {kernel_err.mean():.3e} vs {torch_err.mean():.3e}")
    assert kernel_err.max() <= 1.5 * torch_err.max()
    assert kernel_err.mean() <= torch_err.mean()


def test_float32_kernel_matches_the_torch_path():
    x, gate_up, down, weights, expert_ids = random_moe(77, 16, 4, 256, 96, torch.float32)
    out = fused_moe(x, gate_up, down, weights, expert_ids)
    torch.testing.assert_close(out, moe_reference(x, gate_up, down, weights, expert_ids), atol=1e-5, rtol=1e-4)


def test_kernel_replays_under_a_cuda_graph():
    x, gate_up, down, weights, expert_ids = random_moe(16, 128, 8, 2048, 768, torch.bfloat16)
    fused_moe(x, gate_up, down, weights, expert_ids)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, weights, expert_ids)
    x2, _, _, weights2, expert_ids2 = random_moe(16, 128, 8, 2048, 768, torch.bfloat16, seed=1)
    x.copy_(x2), weights.copy_(weights2), expert_ids.copy_(expert_ids2)  # new tokens, new routing
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x2, gate_up, down, weights2, expert_ids2), atol=0, rtol=0)


NEAR_TIE_NATS = 0.01  # the triton attention kernels multiply float32 in TF32 (10-bit mantissa)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_moe_presets_on_the_gpu_give_transformers_greedy_tokens(preset):
    """float32 on the GPU with CUDA graphs against transformers on the CPU: the same tokens, or a
    divergence only where transformers' own top two tokens are within NEAR_TIE_NATS."""
    from kvmesh import LLM, SamplingParams
    from tests.unit.reference import hf_greedy, hf_model_like

    llm = LLM(f"random:{preset}", device="cuda", dtype="float32", attention_backend="triton",
              kv_cache_memory_bytes=256 << 20, max_model_len=1024)
    assert llm.engine.runner.graph_runner is not None, "decode runs under CUDA graphs"
    prompts = [[(13 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate((3, 40, 200))]
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    reference = hf_model_like(llm)
    for ids, out in zip(prompts, outs):
        expected = hf_greedy(reference, ids, 24)
        if out.token_ids == expected:
            continue
        i = next(j for j, (a, b) in enumerate(zip(expected, out.token_ids)) if a != b)
        with torch.no_grad():
            logits = reference(torch.tensor([ids + expected[:i]])).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        gap = (logprobs[expected[i]] - logprobs[out.token_ids[i]]).item()
        print(f"{preset}: prompt of {len(ids)} tokens diverges at token {i}; gap {gap:.5f} nats")
        assert gap < NEAR_TIE_NATS
    del llm
    gc.collect()
    torch.cuda.empty_cache()
