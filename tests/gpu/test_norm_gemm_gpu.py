"""The norm-and-GEMM kernel (kvmesh.kernels.norm_gemm) on the GPU: at Qwen3-0.6B's shapes against the
launches it replaces (add_rms_norm, cuBLAS, silu_and_mul), eagerly and replayed in a CUDA graph, and
its rotation form (norm_qkv_rotate_store) against norm_gemm followed by rotate_and_store, and the
decoder with them (KVMESH_NORM_GEMM_MAX_TOKENS, KVMESH_NORM_GEMM_ROTATE) against the decoder without:
greedy tokens equal but for near-ties, as test_greedy_qwen3.py judges backends. On the CPU:
tests/unit/test_norm_gemm_kernel.py."""

import pytest
import torch
import torch.nn.functional as F

from qwen3_greedy import generate_greedy

pytestmark = pytest.mark.gpu

NEAR_TIE_NATS = 0.05  # as test_greedy_qwen3.py
REFERENCES = {}
HIDDEN, Q_KV, INTER = 1024, (16 + 2 * 8) * 128, 3072  # Qwen3-0.6B


def unfused(x, residual, norm_weight, weight, bias, silu):
    from kvmesh.kernels.rms_norm import add_rms_norm, rms_norm
    from kvmesh.kernels.silu_and_mul import silu_and_mul

    if residual is None:
        normed, total = rms_norm(x, norm_weight, 1e-6), x
    else:
        normed, total = add_rms_norm(x, residual, norm_weight, 1e-6)
    y = F.linear(normed, weight, bias)
    return (silu_and_mul(y) if silu else y), total


@pytest.mark.parametrize("rows", [1, 7, 64, 200, 256])
@pytest.mark.parametrize("kind", ["qkv", "qkv_bias", "qkv_first_layer", "gate_up"])
def test_kernel_within_the_bf16_band_of_the_launches_it_replaces(rows, kind):
    from kvmesh.kernels.norm_gemm import norm_gemm

    torch.manual_seed(rows)
    silu = kind == "gate_up"
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) * 4
    residual = None if kind == "qkv_first_layer" else torch.randn_like(x) * 4
    norm_weight = (1 + 0.2 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    weight = (torch.randn(2 * INTER if silu else Q_KV, HIDDEN, device="cuda") / HIDDEN ** 0.5).to(torch.bfloat16)
    bias = torch.randn(Q_KV, device="cuda", dtype=torch.bfloat16) if kind == "qkv_bias" else None
    out, total = norm_gemm(x, residual, norm_weight, 1e-6, weight, bias, silu=silu)
    ref, ref_total = unfused(x, residual, norm_weight, weight, bias, silu)
    assert torch.equal(total, ref_total)  # the residual stream bit for bit (torch's bf16 add)
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs()
    # one operand rounded at another point and the sums' order (then, for gate_up, SiLU's and the
    # product's roundings): a few bf16 units of the largest output at most, well under one on average
    assert diff.max() <= 6 * 2 ** -8 * scale.max(), (diff.max(), scale.max())
    assert (diff / (scale + scale.mean())).mean() < 2 ** -7


def test_kernel_replays_in_a_cuda_graph():
    from kvmesh.kernels.norm_gemm import norm_gemm

    x = torch.randn(64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / 32
    eager, eager_total = norm_gemm(x, residual, norm_weight, 1e-6, weight, silu=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, total = norm_gemm(x, residual, norm_weight, 1e-6, weight, silu=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    fresh, fresh_total = norm_gemm(x, residual, norm_weight, 1e-6, weight, silu=True)
    assert torch.equal(out, fresh) and torch.equal(total, fresh_total)
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rotation_form_equals_norm_gemm_then_rotate_and_store(rows, cache_dtype):
    from kvmesh.kernels.norm_gemm import norm_gemm, norm_qkv_rotate_store
    from kvmesh.kernels.rotary import rotate_and_store
    from kvmesh.worker.layers.rotary import RotaryEmbedding
    from kvmesh.worker.presets import hf_config_for

    torch.manual_seed(rows)
    h, hkv, d = 16, 8, 128
    rotary = RotaryEmbedding(hf_config_for("qwen3-0.6b"), d, 4096).cuda()
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) * 4
    residual = torch.randn_like(x) * 4
    norm_weight = (1 + 0.2 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    weight = (torch.randn(Q_KV, HIDDEN, device="cuda") / HIDDEN ** 0.5).to(torch.bfloat16)
    head_norm = ((1 + 0.2 * torch.randn(d, device="cuda")).to(torch.bfloat16),
                 (1 + 0.2 * torch.randn(d, device="cuda")).to(torch.bfloat16), 1e-6)
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:rows]
    slots[0] = -1
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    fused = [torch.zeros(64, 16, hkv, d, device="cuda", dtype=cache_dtype) for _ in range(2)]
    apart = [torch.zeros_like(c) for c in fused]
    q, total = norm_qkv_rotate_store(x, residual, norm_weight, 1e-6, weight, None, h, hkv, positions,
                                     rotary.cos, rotary.sin, *fused, slots, *scales, head_norm=head_norm)
    qkv, ref_total = norm_gemm(x, residual, norm_weight, 1e-6, weight)
    qq, kk, vv = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    ref_q = rotate_and_store(positions, qq.view(rows, h, d), kk.view(rows, hkv, d), vv.view(rows, hkv, d),
                             rotary.cos, rotary.sin, *apart, slots, *scales, norm=head_norm)
    assert torch.equal(total, ref_total)
    # the same product (another compiled kernel may sum it in another order) and the head norm's sum in
    # two halves: where a rounding flips, a unit in the last place of the inputs to the rotation, which
    # can be large beside a small rotated value; elsewhere the same bits
    unit = 2 ** -3 if cache_dtype == torch.float8_e4m3fn else 2 ** -7
    for ours, theirs in [(q, ref_q)] + list(zip(fused, apart)):
        diff = (ours.float() - theirs.float()).abs()
        assert diff.max() <= 2 * unit * theirs.float().abs().max(), diff.max()
        assert (diff > 0).float().mean() < 0.05
    assert not fused[0].view(-1, hkv * d)[slots[1:]].float().eq(0).all(dim=-1).any()  # each slot written


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_greedy_tokens_with_the_kernel_match_those_without(monkeypatch, backend, rotate):
    import importlib.util

    from kvmesh.worker.attention.registry import block_size_for
    from kvmesh.worker.models import decoder

    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn is not installed here")
    block_size = block_size_for(backend)
    monkeypatch.setattr(decoder, "NORM_GEMM_MAX_TOKENS", 0)
    if backend not in REFERENCES:  # the separate launches' run, once a backend for both forms
        REFERENCES[backend] = generate_greedy(backend, block_size=block_size, logprobs=8)
    reference = REFERENCES[backend]
    monkeypatch.setattr(decoder, "NORM_GEMM_MAX_TOKENS", 256)  # every decode step of these 4 prompts
    monkeypatch.setattr(decoder, "NORM_GEMM_ROTATE", rotate)
    taken, rotated = [], []
    real, real_rotation = decoder._norm_gemm_fits, decoder.Attention.rotation_joins_gemm
    monkeypatch.setattr(decoder, "_norm_gemm_fits", lambda *a: taken.append(real(*a)) or taken[-1])
    monkeypatch.setattr(decoder.Attention, "rotation_joins_gemm",
                        lambda self, x: rotated.append(real_rotation(self, x)) or rotated[-1])
    fused = generate_greedy(backend, block_size=block_size, logprobs=8)
    assert any(taken)
    assert any(rotated) == rotate
    for prompt_index, (ref, out) in enumerate(zip(reference, fused)):
        assert len(out.token_ids) == 64
        if out.token_ids == ref.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b)
        gap = max(ref.top_logprobs[i].values()) - ref.top_logprobs[i].get(out.token_ids[i], float("-inf"))
        print(f"{backend}: prompt {prompt_index} diverges at token {i}, logprob gap {gap:.4f}")
        assert gap < NEAR_TIE_NATS, (backend, prompt_index, i, gap)
