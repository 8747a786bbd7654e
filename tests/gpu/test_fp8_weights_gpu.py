"""FP8 weights on the GPU: torch._scaled_mm with row-wise scales (the CUDA path of layers/fp8.py)
against the reference math the CPU runs (dequantized operands, float32 product) at Qwen3-0.6B's
linear shapes, eager and inside a CUDA graph; the Triton row quantizer's bytes against torch's;
then whole models with quantization="fp8", CUDA graphs on:

- against bf16: the quantization's own effect. Bounds: tiny-qwen3 0.05 nats (measured 0.024 in
  float32 on the CPU, 0.025 here); the 0.6B max 0.5 / mean 0.1 (measured 0.347 / 0.077 with one
  activation scale per tensor, 2026-12-01; per token should not be worse);
- the cuBLAS path against the same quantized model computed by the reference math: nearer each
  other than bf16 (see that test for why not the bf16 band).

Logprobs are absolute nats of random-weight models (near-uniform logits); the figures are printed
(run with -s) for docs/PERF.md."""

import gc

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.worker.layers.fp8 import (_scaled_mm_fits, dequantize, fp8_linear, quantize_per_tensor,
                                      quantize_per_token, quantize_per_token_torch, row_scale)

pytestmark = pytest.mark.gpu

# Qwen3-0.6B: hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072 -> (out, in) of each linear
QWEN3_06B_LINEARS = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
                     "down_proj": (1024, 3072)}
# both sides accumulate in float32 and round once to bf16 (2^-8 relative); the order of the sums differs
GEMM_RTOL = 2.0 ** -6
PROMPTS = [[(17 * i + 3 * j) % 10000 for j in range(n)] for i, n in enumerate((5, 77, 300))]


def reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_per_token_torch(x)
    return (dequantize(x_q, x_scale) @ dequantize(w_q, w_scale).t()).to(x.dtype)


@pytest.mark.parametrize("name", sorted(QWEN3_06B_LINEARS))
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
def test_scaled_mm_matches_the_reference_math(name, num_tokens):
    out_features, in_features = QWEN3_06B_LINEARS[name]
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_tokens, in_features, device="cuda", generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, device="cuda", generator=generator) * 0.02
    w_q, w_scale = quantize_per_tensor(weight)
    assert _scaled_mm_fits(x, w_q)  # the cuBLAS path, not the fallback
    expected = reference(x, w_q, w_scale)
    for scale in (w_scale, row_scale(w_scale, out_features)):  # the second as the model stores it
        out = fp8_linear(x, w_q, scale)
        torch.testing.assert_close(out.float(), expected.float(), rtol=GEMM_RTOL,
                                   atol=GEMM_RTOL * expected.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1024), (300, 3072), (5, 12288)])  # 12288 > one block of the kernel
def test_the_row_quantizer_kernel_writes_the_torch_bytes(dtype, shape):
    generator = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(*shape, device="cuda", generator=generator) * 7).to(dtype)
    x[0, :5] = torch.tensor([448.0, -448.0, 1e-3, 0.0, 3.0])  # ties and carries happen in random data too
    q, scale = quantize_per_token(x)  # on CUDA: the Triton kernel
    q_ref, scale_ref = quantize_per_token_torch(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_scaled_mm_in_a_cuda_graph_computes_each_replay_scale_on_the_device():
    out_features, in_features = QWEN3_06B_LINEARS["gate_up_proj"]
    generator = torch.Generator(device="cuda").manual_seed(1)
    w_q, w_scale = quantize_per_tensor(torch.randn(out_features, in_features, device="cuda", generator=generator))
    static_x = torch.randn(8, in_features, device="cuda", generator=generator).to(torch.bfloat16)
    fp8_linear(static_x, w_q, w_scale)  # warm up (cuBLAS workspace) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_linear(static_x, w_q, w_scale)
    for scale in (0.01, 1.0, 100.0):  # a new amax each replay: the captured scale must follow it
        static_x.copy_(torch.randn(8, in_features, device="cuda", generator=generator) * scale)
        graph.replay()
        eager = fp8_linear(static_x, w_q, w_scale).float()
        # a stale scale would be off by the factor between replays (saturated or flushed to zero)
        torch.testing.assert_close(static_out.float(), eager, rtol=GEMM_RTOL,
                                   atol=GEMM_RTOL * eager.abs().max().item())


def generate(model: str, quantization):
    llm = LLM(model=model, device="cuda", dtype="bfloat16", quantization=quantization,
              kv_cache_memory_bytes=2 << 30, max_model_len=2048, max_num_seqs=8)
    vocab = llm.engine.model_config.vocab_size  # tiny-qwen3's is 512
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=8, prompt_logprobs=1)
    outs = llm.generate(prompt_token_ids=[[t % vocab for t in p] for p in PROMPTS], sampling_params=params,
                        use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def prompt_logprob_diffs(one_run, other_run) -> list[float]:
    return [abs(a - b) for one, two in zip(one_run, other_run)
            for a, b in zip(one.prompt_logprobs.logprobs[1:], two.prompt_logprobs.logprobs[1:])]


def mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("model,max_nats,mean_nats", [("random:tiny-qwen3", 0.05, 0.05),
                                                      ("random:qwen3-0.6b", 0.5, 0.1)])
def test_fp8_model_logprobs_are_within_tolerance_of_bf16(model, max_nats, mean_nats):
    bf16, fp8 = generate(model, None), generate(model, "fp8")
    worst_first = 0.0
    for one, two in zip(bf16, fp8):
        # the first generated token: the same prefix on both sides, so its logprob is comparable
        worst_first = max(worst_first, abs(one.top_logprobs[0][one.token_ids[0]]
                                           - two.top_logprobs[0].get(one.token_ids[0], float("-inf"))))
        if two.token_ids[0] != one.token_ids[0]:  # only a near-tie in the bf16 run may flip it
            top = one.top_logprobs[0]
            assert max(top.values()) - top.get(two.token_ids[0], float("-inf")) < max_nats
    diffs = prompt_logprob_diffs(bf16, fp8)
    print(f"{model}: fp8 vs bf16 |logprob difference| over {len(diffs)} prompt positions: max "
          f"{max(diffs):.4f}, mean {mean(diffs):.5f}; first token {worst_first:.4f} (bounds {max_nats} / {mean_nats})")
    assert max(diffs) < max_nats and worst_first < max_nats and mean(diffs) < mean_nats


def test_the_scaled_mm_model_is_nearer_the_reference_math_model_than_bf16(monkeypatch):
    """The same FP8 model through cuBLAS and through the float32 reference math (the fallback
    forced). Not the bf16 band of two kernels: a last-bit difference in a layer's input moves a
    token's scale and re-rounds its whole row, so two correct FP8 paths drift apart by FP8 rounding;
    but they share every weight's rounding, so they must stay nearer each other than either is to
    bf16. A wrong scale or layout would put them as far apart as bf16 or farther."""
    import kvmesh.worker.layers.fp8 as fp8

    model = "random:qwen3-0.6b"
    bf16, kernel = generate(model, None), generate(model, "fp8")
    monkeypatch.setattr(fp8, "_scaled_mm_fits", lambda x, weight: False)
    reference_math = generate(model, "fp8")
    apart, from_bf16 = prompt_logprob_diffs(kernel, reference_math), prompt_logprob_diffs(kernel, bf16)
    print(f"fp8 weights, {len(apart)} prompt positions: _scaled_mm vs the reference math max "
          f"{max(apart):.4f} mean {mean(apart):.5f}; _scaled_mm vs bf16 max {max(from_bf16):.4f} "
          f"mean {mean(from_bf16):.5f}")
    assert mean(apart) < 0.75 * mean(from_bf16) and max(apart) < 0.5
