"""The fused Triton RMSNorm (alone and with the residual add), rotary (alone and with Qwen3's q / k norms)
and SiLU-and-mul kernels against the torch code they replace
(kvmesh.worker.layers on the CPU path), on fresh random bf16 inputs: equal within one bf16 rounding."""

import itertools

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    # at most one bf16 ulp of the reference value (rounding order), nothing else
    assert torch.all(diff <= ref.float().abs() * 2 ** -7 + 1e-6), diff.max()
    assert (diff > 0).float().mean() < 0.02


def test_rms_norm_2d_and_strided_heads():
    from kvmesh.kernels.rms_norm import rms_norm
    from kvmesh.worker.layers.norm import RMSNorm

    norm = RMSNorm(1024, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(1024, dtype=torch.bfloat16)
    x = torch.randn(37, 1024, dtype=torch.bfloat16)
    close(rms_norm(x.cuda(), norm.weight.cuda(), 1e-6).cpu(), norm(x))
    qkv = torch.randn(37, (16 + 2 * 8) * 128, dtype=torch.bfloat16)
    q = qkv[:, :16 * 128].view(37, 16, 128)  # strided rows, as split off the qkv projection
    head_norm = RMSNorm(128, 1e-6).to(torch.bfloat16)
    head_norm.weight.data = torch.randn(128, dtype=torch.bfloat16)
    close(rms_norm(q.cuda(), head_norm.weight.cuda(), 1e-6).cpu(), head_norm(q))


def test_rotary_matches_layer():
    from kvmesh.kernels.rotary import apply_rotary
    from kvmesh.worker.layers import rotary
    from kvmesh.worker.presets import hf_config_for

    emb = rotary.RotaryEmbedding(hf_config_for("qwen3-0.6b"), 128, 4096)
    positions = torch.randint(0, 4096, (53,))
    q = torch.randn(53, 16, 128, dtype=torch.bfloat16)
    k = torch.randn(53, 8, 128, dtype=torch.bfloat16)
    ref_q, ref_k = emb(positions, q, k)  # CPU path: the torch code
    out_q, out_k = apply_rotary(positions.cuda(), q.cuda(), k.cuda(), emb.cos.cuda(), emb.sin.cuda())
    close(out_q.cpu(), ref_q)
    close(out_k.cpu(), ref_k)


def test_silu_and_mul():
    from kvmesh.kernels.silu_and_mul import silu_and_mul

    x = torch.randn(29, 2 * 3072, dtype=torch.bfloat16)
    gate, up = x.split(3072, dim=-1)
    close(silu_and_mul(x.cuda()).cpu(), F.silu(gate) * up)


def test_add_rms_norm_equals_the_add_and_the_norm_kernel_bit_for_bit():
    """The residual form in one launch: the sum is torch's bf16 add, the norm the rms_norm kernel's."""
    from kvmesh.kernels.rms_norm import add_rms_norm, rms_norm
    from kvmesh.worker.layers.norm import RMSNorm

    for hidden in (1024, 4096, 96):
        x = torch.randn(37, hidden, dtype=torch.bfloat16, device="cuda")
        r = torch.randn(37, hidden, dtype=torch.bfloat16, device="cuda") * 4
        w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
        normed, total = add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(total, x + r)
        assert torch.equal(normed, rms_norm(x + r, w, 1e-6))
        layer = RMSNorm(hidden, 1e-6).to(torch.bfloat16)
        layer.weight.data = w.cpu()
        ref_normed, ref_total = layer(x.cpu(), r.cpu())  # the torch path
        close(normed.cpu(), ref_normed)
        assert torch.equal(total.cpu(), ref_total)


def test_qk_norm_rotary_equals_the_three_kernels_bit_for_bit():
    """Qwen3's q / k norms and the rotation in one launch, on strided views of a qkv projection."""
    from kvmesh.kernels.rms_norm import rms_norm
    from kvmesh.kernels.rotary import apply_qk_norm_rotary, apply_rotary
    from kvmesh.worker.layers import rotary
    from kvmesh.worker.layers.norm import RMSNorm
    from kvmesh.worker.presets import hf_config_for

    emb = rotary.RotaryEmbedding(hf_config_for("qwen3-0.6b"), 128, 4096).cuda()
    # 53 tokens: one head a program; 2,100: eight (kvmesh.kernels.rotary.heads_per_program)
    for (heads, kv_heads), n in itertools.product(((16, 8), (32, 8)), (53, 2100)):
        qkv = torch.randn(n, (heads + 2 * kv_heads) * 128, dtype=torch.bfloat16, device="cuda")
        q = qkv[:, :heads * 128].view(n, heads, 128)
        k = qkv[:, heads * 128:(heads + kv_heads) * 128].view(n, kv_heads, 128)
        wq, wk = (torch.randn(128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        positions = torch.randint(0, 4096, (n,), device="cuda")
        fq, fk = apply_qk_norm_rotary(positions, q, k, wq, wk, 1e-6, emb.cos, emb.sin)
        sq, sk = apply_rotary(positions, rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6), emb.cos, emb.sin)
        assert torch.equal(fq, sq) and torch.equal(fk, sk)
        qn, kn = RMSNorm(128, 1e-6).to(torch.bfloat16), RMSNorm(128, 1e-6).to(torch.bfloat16)
        qn.weight.data, kn.weight.data = wq.cpu(), wk.cpu()
        emb_cpu = rotary.RotaryEmbedding(hf_config_for("qwen3-0.6b"), 128, 4096)
        rq, rk = emb_cpu(positions.cpu(), qn(q.cpu()), kn(k.cpu()))  # the torch path
        for out, ref in ((fq.cpu(), rq), (fk.cpu(), rk)):  # the rotation mixes a row's roundings
            assert (out.float() - ref.float()).abs().max() <= 2 ** -6 * ref.float().abs().max()


def decode_step_inputs(tokens: int):
    """Qwen3-0.6B's rotary table, q / k / v as strided views of a qkv projection (16 + 8 + 8 heads),
    positions, and cache slots for `tokens` tokens, two of them CUDA-graph padding (-1)."""
    from kvmesh.worker.layers import rotary
    from kvmesh.worker.presets import hf_config_for

    emb = rotary.RotaryEmbedding(hf_config_for("qwen3-0.6b"), 128, 4096).cuda()
    heads, kv_heads = 16, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 128, dtype=torch.bfloat16, device="cuda") * 3
    q = qkv[:, :heads * 128].view(tokens, heads, 128)
    k = qkv[:, heads * 128:(heads + kv_heads) * 128].view(tokens, kv_heads, 128)
    v = qkv[:, (heads + kv_heads) * 128:].view(tokens, kv_heads, 128)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    slots = torch.randperm(40 * 16, device="cuda")[:tokens]
    slots[[3, 17]] = -1
    return emb, q, k, v, positions, slots


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("normed", [False, True])
def test_rotate_and_store_writes_the_bytes_of_the_rotation_then_store_kvcache(cache_dtype, normed):
    """The rotation writing K / V into the paged cache in its own launch: q as the rotation's, the cache
    byte for byte as kvmesh's store kernel after it (FP8: the same scaling and clamp), padding skipped."""
    from kvmesh.kernels.rotary import apply_qk_norm_rotary, apply_rotary, rotate_and_store
    from kvmesh.kernels.store_kvcache import store_kvcache

    emb, q, k, v, positions, slots = decode_step_inputs(53)
    kv_heads = 8
    norm = tuple(torch.randn(128, dtype=torch.bfloat16, device="cuda") for _ in range(2)) + (1e-6,) if normed else None
    fused = [torch.zeros(40, 16, kv_heads, 128, dtype=cache_dtype, device="cuda") for _ in range(2)]
    apart = [torch.zeros_like(c) for c in fused]
    fq = rotate_and_store(positions, q, k, v, emb.cos, emb.sin, *fused, slots, 0.75, 1.5, norm=norm)
    sq, sk = (apply_qk_norm_rotary(positions, q, k, *norm, emb.cos, emb.sin) if normed
              else apply_rotary(positions, q, k, emb.cos, emb.sin))
    store_kvcache(sk, v, *apart, slots, 0.75, 1.5)
    assert torch.equal(fq, sq)
    for a, b in zip(fused, apart):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert fused[0].view(torch.uint8).count_nonzero() > 0


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_the_heads_as_rows_of_one_tile_write_the_bits_of_one_head_a_program(rows):
    """KVMESH_ROTARY_ROWS (an experiment, kvmesh.kernels.rotary.ROWS): the normed rotation storing
    K / V with `rows` heads a program as one tile, at a decode step's shape (256 tokens, Qwen3-0.6B's
    16 + 8 heads), equals one head a program bit for bit: q, and the cache's bytes."""
    from kvmesh.kernels.rotary import _launch

    emb, q, k, v, positions, slots = decode_step_inputs(256)
    kv_heads = 8
    norm = (torch.randn(128, dtype=torch.bfloat16, device="cuda"),
            torch.randn(128, dtype=torch.bfloat16, device="cuda"), 1e-6)
    outs = []
    for r in (0, rows):
        cache = [torch.zeros(40, 16, kv_heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        fq = _launch(positions, q, k, emb.cos, emb.sin, norm=norm, store=(v, *cache, slots, 1.0, 1.0), rows=r)[0]
        outs.append((fq, cache))
    (q1, c1), (qr, cr) = outs
    assert torch.equal(q1, qr)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(c1, cr))
