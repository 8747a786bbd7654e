"""FP8 (e4m3) weights, `quantization="fp8"`, on the CPU: the reference path computes the function the
GPU's torch._scaled_mm computes (weights quantized per tensor, activations per token, float32
accumulation), so these tolerances are the FP8 error itself. The GPU side is tests/gpu/test_fp8_weights_gpu.py."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from kvmesh import LLM, SamplingParams
from kvmesh.config import EngineConfig
from kvmesh.serve_config import parse_config
from kvmesh.worker.layers.fp8 import (FP8_DTYPE, FP8_MAX, check_quantization, dequantize, fp8_linear,
                                      quantize_per_tensor, quantize_per_token)
from tests.triton_interpret import run_interpreted
from kvmesh.worker.layers.parallel import ColumnParallelLinear, RowParallelLinear
from kvmesh.worker.model_builder import build_model

# e4m3 keeps 3 mantissa bits: normal values are 2^-3 (relative) apart, so one rounds to within
# 2^-4 of itself; subnormals (below 2^-6) are 2^-9 apart
E4M3_RELATIVE_ERROR = 2.0 ** -4
# An FP8 linear against float32 on N(0, 1) data at K=256: measured 0.03-0.04 relative (Frobenius)
LINEAR_RELATIVE_TOLERANCE = 0.06
# random:tiny-qwen3 (float32, 2 layers): measured max |logprob difference| 0.024 over the sampled
# tokens and prompt logprobs of PROMPTS (2026-12-01); the weights are N(0, 0.02), so logits are
# near-uniform and the difference is absolute nats
LOGPROB_TOLERANCE = 0.05
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16)
PROMPTS = [list(range(1, 40, 3)), list(range(1, 40, 3)) + [9, 8, 7], [300, 12, 99], [5, 77, 500, 42, 7, 123]]


def generate(quantization, tensor_parallel_size=1, kv_cache_dtype="auto"):
    with LLM("random:tiny-qwen3", quantization=quantization, tensor_parallel_size=tensor_parallel_size,
             kv_cache_dtype=kv_cache_dtype, **ENGINE) as llm:
        params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, prompt_logprobs=1)
        return llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)


# ---- the numbers ------------------------------------------------------------------------------

def test_quantize_dequantize_round_trip_within_e4m3_precision():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :16] = torch.linspace(-1, 1, 16) * 2.0 ** -7 * x.abs().max() / FP8_MAX  # subnormal once scaled
    q, scale = quantize_per_tensor(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (1,)
    assert scale.item() == pytest.approx(x.abs().max().item() / FP8_MAX)
    back = dequantize(q, scale)
    assert back.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)  # the amax is exact
    # normal range: relative error within half a step; below it (subnormals), an absolute one
    normal = x.abs() / scale >= 2.0 ** -6
    assert ((back - x).abs() / x.abs())[normal].max() <= E4M3_RELATIVE_ERROR
    assert (back - x)[~normal].abs().max() <= 2.0 ** -10 * scale.item()


def test_zero_tensor_gets_a_finite_scale():
    q, scale = quantize_per_tensor(torch.zeros(4, 16))
    assert torch.isfinite(scale).all() and (dequantize(q, scale) == 0).all()


def test_fp8_linear_matches_the_float32_linear_within_tolerance():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 256, generator=generator)  # leading dims are kept
    weight = torch.randn(96, 256, generator=generator) * 0.02
    bias = torch.randn(96, generator=generator)
    w_q, w_scale = quantize_per_tensor(weight)
    out = fp8_linear(x, w_q, w_scale, bias)
    expected = F.linear(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == x.dtype
    error = (out - expected).norm() / (expected - bias).norm()
    assert error < LINEAR_RELATIVE_TOLERANCE


def test_fp8_linear_is_the_product_of_the_quantized_operands():
    """What torch._scaled_mm computes: (x_q * s_x) (w_q * s_w)^T, accumulated in float32."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(7, 64, generator=generator).to(torch.bfloat16)
    w_q, w_scale = quantize_per_tensor(torch.randn(32, 64, generator=generator))
    x_q, x_scale = quantize_per_token(x)
    expected = (dequantize(x_q, x_scale) @ dequantize(w_q, w_scale).t()).to(torch.bfloat16)
    out = fp8_linear(x, w_q, w_scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=1e-6)


def test_activations_take_one_scale_per_token():
    """A row's scale is its own amax / 448: an outlier token does not coarsen the other rows (as one
    scale per tensor would), and a padding row of a CUDA-graph batch changes no real row."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=generator)
    q, scale = quantize_per_token(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (4, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:, 0], x.abs().amax(dim=1) / FP8_MAX, rtol=2 ** -23, atol=0)
    with_outlier = torch.cat([x, torch.full((1, 64), 1e4)])
    q2, scale2 = quantize_per_token(with_outlier)
    assert torch.equal(scale2[:4], scale) and torch.equal(q2[:4].float(), q.float())
    assert (dequantize(q, scale) - x).abs().max() <= E4M3_RELATIVE_ERROR * x.abs().max()


def test_the_triton_row_quantizer_computes_the_torch_numbers():
    """kvmesh.kernels.fp8_quant under Triton's interpreter against quantize_per_token's torch form.
    The interpreter rounds ties away from zero and drops the carry into the next power of two (see
    test_fp8_kv_kernels.py), so the bytes are compared exactly on rows whose values round down (e4m3
    values nudged up by under a quarter step, times a power of two, 448 in each row: the scale is
    exact); on random rows, the scales exactly and most bytes. On the GPU every byte is compared
    (tests/gpu/test_fp8_weights_gpu.py). A row longer than one block; an all-zero row."""
    result = run_interpreted(textwrap.dedent("""
        import json, torch
        from kvmesh.kernels.fp8_quant import quantize_rows
        from kvmesh.worker.layers.fp8 import _MIN_SCALE, quantize_per_token_torch
        out = {}
        gen = torch.Generator().manual_seed(0)
        e4m3 = torch.arange(1, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # up to 416
        grid = torch.cat([e4m3, -e4m3, torch.tensor([0.0])])
        grid = grid * (1 + torch.rand(grid.shape, generator=gen) * 2 ** -6)
        rows = torch.stack([torch.cat([grid, torch.tensor([448.0])]) * s for s in (1.0, 2.0 ** -5, 2.0 ** 7)])
        q, scale = quantize_rows(rows, _MIN_SCALE)
        q_ref, scale_ref = quantize_per_token_torch(rows)
        out["grid"] = dict(bytes_equal=torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)),
                           scales=scale[:, 0].tolist())
        for cols in (48, 9000):  # 9000 > MAX_BLOCK: read in two blocks
            x = torch.randn(3, cols, generator=gen) * torch.tensor([[1.0], [300.0], [0.0]])
            q, scale = quantize_rows(x, _MIN_SCALE)
            q_ref, scale_ref = quantize_per_token_torch(x)
            out[cols] = dict(scales_equal=torch.equal(scale, scale_ref), shape=list(scale.shape),
                             equal_share=(q.float() == q_ref.float()).float().mean().item(),
                             zero_row=bool((q[2].float() == 0).all()))
        print(json.dumps(out))
    """))
    grid = result.pop("grid")
    assert grid["bytes_equal"] and grid["scales"] == [1.0, 2.0 ** -5, 2.0 ** 7]
    for cols, r in result.items():
        assert r["scales_equal"] and r["shape"] == [3, 1] and r["zero_row"], (cols, r)
        assert r["equal_share"] > 0.95, (cols, r)


# ---- the model --------------------------------------------------------------------------------

def test_linear_layers_are_fp8_and_the_rest_stays_in_the_model_dtype():
    net = build_model("random:tiny-qwen3", torch.device("cpu"), torch.float32, quantization="fp8").model
    linears = [m for m in net.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(linears) == 4 * net.config.num_layers  # qkv, o, gate_up, down
    for layer in linears:
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    assert net.model.embed_tokens.weight.dtype == torch.float32
    assert net.lm_head.weight.dtype == torch.float32
    assert net.model.norm.weight.dtype == torch.float32
    assert net.model.layers[0].self_attn.q_norm.weight.dtype == torch.float32


def test_linear_weight_memory_halves_against_bf16():
    def linear_weight_bytes(net):
        return sum(m.weight.numel() * m.weight.element_size() for m in net.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))

    bf16 = build_model("random:tiny-qwen3", torch.device("cpu"), torch.bfloat16).model
    fp8 = build_model("random:tiny-qwen3", torch.device("cpu"), torch.bfloat16, quantization="fp8").model
    assert linear_weight_bytes(fp8) * 2 == linear_weight_bytes(bf16)


def test_fp8_model_matches_the_unquantized_model_within_the_measured_tolerance():
    plain, fp8 = generate(None), generate("fp8")
    for one, two in zip(plain, fp8):
        assert two.token_ids == one.token_ids
        assert two.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)
        assert two.prompt_logprobs.logprobs[1:] == pytest.approx(one.prompt_logprobs.logprobs[1:],
                                                                 abs=LOGPROB_TOLERANCE)
    # and it is not the same model: the quantization did change the numbers
    assert any(a.logprobs != b.logprobs for a, b in zip(plain, fp8))


def test_fp8_weights_with_an_fp8_kv_cache_stay_within_the_tolerance():
    """Both halves of FP8 together (measured 0.025 nats, 2026-12-01)."""
    plain, fp8 = generate(None), generate("fp8", kv_cache_dtype="fp8")
    for one, two in zip(plain, fp8):
        assert two.token_ids == one.token_ids
        assert two.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)


def test_two_ranks_with_fp8_give_one_rank_fp8_tokens():
    """Each rank quantizes its own shard (its own scale), so logprobs move by FP8 error, not by
    float32 rounding; the greedy tokens are the same."""
    single, split = generate("fp8", 1), generate("fp8", 2)
    for one, two in zip(single, split):
        assert two.token_ids == one.token_ids
        assert two.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)


# ---- the option -------------------------------------------------------------------------------

def test_unsupported_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"quantization must be None or 'fp8', got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"quantization must be None or 'fp8', got 'FP8'"):
        LLM("random:tiny-qwen3", device="cpu", quantization="FP8")


def test_mixture_of_experts_is_refused_with_fp8():
    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported for mixture-of-experts"):
        LLM("random:tiny-qwen3-moe", device="cpu", quantization="fp8")


def test_serving_field_reaches_the_engine_config():
    assert parse_config({}).engine_config("w").quantization is None
    cfg = parse_config({"engine": {"quantization": "fp8"}})
    assert cfg.engine_config("w").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization"):
        parse_config({"engine": {"quantization": "int8"}})


def test_a_gpu_without_fp8_support_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a GPU of compute capability 8.9 or newer "
                                         r"\(Ada, Hopper\); NVIDIA A100 is 8.0"):
        check_quantization("fp8", torch.device("cuda:0"), moe=False)
    check_quantization(None, torch.device("cuda:0"), moe=True)  # nothing to check without quantization
