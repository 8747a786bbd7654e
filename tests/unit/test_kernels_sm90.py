"""Every Triton kernel of kvmesh.kernels compiled for an H100 / H200 on this CPU machine
(tests/triton_aot.py), as the engine launches it on Qwen3-0.6B (and the MoE preset's expert shapes):
decode steps of 256 sequences, prompt steps of 4,096 tokens, bf16 and FP8 KV caches, pages of 256
(flash_attn) and 16 (triton). Each launch compiles for sm_90, fits the shared memory and spills no
register. A kernel change that only a GPU's compiler would reject fails here, on the CPU, before a
GPU call. Triton's version here may differ from the GPU machine's (a check of the kernel's form);
what the kernels compute is tested under the interpreter and on the GPU."""

import pytest
import torch

from tests.triton_aot import SHARED_LIMIT, captured_launches, compile_sm90, unsupported

pytestmark = pytest.mark.skipif(unsupported() is not None, reason=str(unsupported()))

BF, FP8 = torch.bfloat16, torch.float8_e4m3fn
T, H, HKV, D, HIDDEN = 256, 16, 8, 128, 1024  # a decode step of Qwen3-0.6B
PROMPT = 4096


def norms():
    from kvmesh.kernels.rms_norm import add_rms_norm, rms_norm

    x, w = torch.randn(T, HIDDEN, dtype=BF), torch.ones(HIDDEN, dtype=BF)
    rms_norm(x, w, 1e-6)
    rms_norm(torch.randn(T, (H + 2 * HKV) * D, dtype=BF)[:, :H * D].view(T, H, D), torch.ones(D, dtype=BF), 1e-6)
    add_rms_norm(x, x.clone(), w, 1e-6)


def rotation():
    from kvmesh.kernels.rotary import apply_qk_norm_rotary, apply_rotary, rotate_and_store

    cos, sin = torch.ones(4096, D // 2), torch.zeros(4096, D // 2)
    w = torch.ones(D, dtype=BF)
    for tokens in (T, PROMPT):  # one head a program, then eight
        qkv = torch.randn(tokens, (H + 2 * HKV) * D, dtype=BF)
        q, k, v = (qkv[:, :H * D].view(tokens, H, D), qkv[:, H * D:(H + HKV) * D].view(tokens, HKV, D),
                   qkv[:, (H + HKV) * D:].view(tokens, HKV, D))
        positions, slots = torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.int64)
        apply_rotary(positions, q, k, cos, sin)
        apply_qk_norm_rotary(positions, q, k, w, w, 1e-6, cos, sin)
        for dtype in (BF, FP8):
            caches = [torch.zeros(4, 256, HKV, D, dtype=dtype) for _ in range(2)]
            rotate_and_store(positions, q, k, v, cos, sin, *caches, slots, norm=(w, w, 1e-6))


def kv_store():
    from kvmesh.kernels.store_kvcache import store_kvcache

    k = torch.randn(T, HKV, D, dtype=BF)
    for dtype in (BF, FP8):
        store_kvcache(k, k, *[torch.zeros(4, 16, HKV, D, dtype=dtype) for _ in range(2)],
                      torch.zeros(T, dtype=torch.int64), 0.5, 0.5)


def mlp():
    from kvmesh.kernels.fp8_quant import quantize_rows
    from kvmesh.kernels.silu_and_mul import silu_and_mul

    silu_and_mul(torch.randn(T, 2 * 3072, dtype=BF))
    quantize_rows(torch.randn(T, HIDDEN, dtype=BF), 1e-12)


def decode_attention():
    from kvmesh.kernels.paged_decode import paged_decode

    q = torch.randn(T, H, D, dtype=BF)
    seq_lens = torch.full((T,), 600, dtype=torch.int32)
    for page in (256, 16):
        for dtype in (BF, FP8):
            cache = torch.zeros(4, page, HKV, D, dtype=dtype)
            tables = torch.zeros(T, 4096 // page, dtype=torch.int32)
            paged_decode(q, cache, cache, torch.empty_like(q), seq_lens, tables, 0.088, 8, chunk=512)  # the default
            paged_decode(q, cache, cache, torch.empty_like(q), seq_lens, tables, 0.088, 4)  # splits by SM count


def prefill_attention():
    from kvmesh.kernels.paged_prefill import paged_prefill

    q = torch.randn(PROMPT, H, D, dtype=BF)
    starts = torch.tensor([0, 2048, PROMPT], dtype=torch.int32)
    for page in (256, 16):
        for dtype in (BF, FP8):
            cache = torch.zeros(4, page, HKV, D, dtype=dtype)
            paged_prefill(q, cache, cache, torch.empty_like(q), starts, torch.tensor([2048, 2048], dtype=torch.int32),
                          torch.zeros(2, 4096 // page, dtype=torch.int32), 2048, 0.088)
            paged_prefill(q[:17], cache, cache, torch.empty_like(q[:17]), torch.tensor([0, 17], dtype=torch.int32),
                          torch.tensor([17], dtype=torch.int32), torch.zeros(1, 4096 // page, dtype=torch.int32),
                          17, 0.088)  # a short prompt's tile


def sampler():
    from kvmesh.kernels.sample import sample_from_logits

    sample_from_logits(torch.randn(8, 151_936, dtype=BF), torch.ones(8), 1234)


def moe():
    from kvmesh.kernels.fused_moe import fused_moe

    experts, hidden, inter, top_k = 8, 2048, 768, 8  # the MoE preset's expert shape, fewer experts
    x = torch.randn(T, hidden, dtype=BF)
    ids = torch.randint(0, experts, (T, top_k))
    fused_moe(x, torch.randn(experts, 2 * inter, hidden, dtype=BF), torch.randn(experts, hidden, inter, dtype=BF),
              torch.full((T, top_k), 1 / top_k), ids)


CASES = {f.__name__: f for f in (norms, rotation, kv_store, mlp, decode_attention, prefill_attention, sampler, moe)}


@pytest.mark.parametrize("case", CASES)
def test_each_launch_compiles_for_sm90_within_shared_memory_and_without_spills(case):
    with captured_launches() as launches:
        CASES[case]()
    assert launches
    for launch in launches:
        compiled = compile_sm90(launch)
        assert compiled.shared <= SHARED_LIMIT, compiled
        assert compiled.spill_bytes == 0, compiled
