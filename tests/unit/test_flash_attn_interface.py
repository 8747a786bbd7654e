"""The flash_attn backend's calls, checked on the CPU against a reference implementation of
flash-attn's documented interface (tests/flash_attn_reference.py), injected as `flash_attn`
because CI cannot install flash-attn. tests/gpu/test_attention_backends.py runs the real build."""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # flash_attn_reference
sys.path.insert(0, str(TESTS / "gpu"))  # attention_cases (device-agnostic helpers)

import flash_attn_reference  # noqa: E402
from attention_cases import make_case, reference_attention, relative_error  # noqa: E402


@pytest.fixture
def backend_cls(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_reference)
    from kvmesh.worker.attention.flash_attn_backend import FlashAttnAttentionBackend
    return FlashAttnAttentionBackend


def run_backend(backend_cls, case, num_heads, num_kv_heads, head_dim, page):
    backend = backend_cls(num_heads, num_kv_heads, head_dim, page, case.scale, torch.device("cpu"), torch.bfloat16)
    backend.plan(case.metadata)
    return backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_step_matches_float32_reference(backend_cls, num_heads, num_kv_heads, head_dim):
    case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page=256,
                     decode_ctx=[1, 300, 513], prompt_lens=[7, 40, 1], prefix_lens=[0, 256, 600],
                     device="cpu", seed=num_heads * 100 + num_kv_heads + head_dim)
    ref = reference_attention(case)
    out = run_backend(backend_cls, case, num_heads, num_kv_heads, head_dim, 256)
    assert out.shape == case.q.shape and out.dtype == torch.bfloat16
    assert relative_error(out, ref) < 1e-2


def test_prefill_only_and_decode_only_steps(backend_cls):
    for decode_ctx, prompt_lens, prefix_lens in (([], [300, 5], [0, 700]), ([2, 257, 1000], [], [])):
        case = make_case(num_heads=8, num_kv_heads=2, head_dim=128, page=256, decode_ctx=decode_ctx,
                         prompt_lens=prompt_lens, prefix_lens=prefix_lens, device="cpu", seed=len(decode_ctx))
        out = run_backend(backend_cls, case, 8, 2, 128, 256)
        assert relative_error(out, reference_attention(case)) < 1e-2


def test_new_kv_is_written_to_the_cache_by_slot(backend_cls):
    case = make_case(num_heads=4, num_kv_heads=2, head_dim=64, page=256, decode_ctx=[10],
                     prompt_lens=[20], prefix_lens=[5], device="cpu")
    run_backend(backend_cls, case, 4, 2, 64, 256)
    flat_k = case.k_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[case.metadata.slot_mapping], case.k)


@pytest.mark.parametrize("decode_ctx,prompt_lens,prefix_lens", [([3, 300], [20], [5]), ([2, 257, 1000], [], [])])
def test_kv_the_rotation_already_stored_is_read_from_the_cache(backend_cls, decode_ctx, prompt_lens, prefix_lens):
    """k = v = None (kvmesh.kernels.rotary.rotate_and_store wrote them): the backend stores nothing
    and attends over the cache as it is, in a mixed step and a decode step (which returns the
    kernel's own output, no copy)."""
    case = make_case(num_heads=8, num_kv_heads=2, head_dim=128, page=256, decode_ctx=decode_ctx,
                     prompt_lens=prompt_lens, prefix_lens=prefix_lens, device="cpu", seed=7)
    for cache, new in ((case.k_cache, case.k), (case.v_cache, case.v)):
        cache.view(-1, 2, 128)[case.metadata.slot_mapping] = new
    before = case.k_cache.clone()
    backend = backend_cls(8, 2, 128, 256, case.scale, torch.device("cpu"), torch.bfloat16)
    returned = []
    decode = backend._with_kvcache
    backend._with_kvcache = lambda *a, **kw: returned.append(decode(*a, **kw)) or returned[-1]
    backend.plan(case.metadata)
    out = backend.forward(case.q, None, None, case.k_cache, case.v_cache, case.metadata)
    assert torch.equal(case.k_cache, before)
    assert relative_error(out, reference_attention(case)) < 1e-2
    # a decode step hands back flash-attn's own output; a mixed one copies it into the joint output
    assert (out.data_ptr() == returned[0].data_ptr()) == (not prompt_lens)
    case.k_cache.view(-1, 2, 128)[case.metadata.slot_mapping] = 0  # now the step's keys are gone
    assert relative_error(backend.forward(case.q, None, None, case.k_cache, case.v_cache, case.metadata),
                          reference_attention(case)) > 1e-2


def test_block_size_not_multiple_of_256_is_a_clear_error(backend_cls):
    with pytest.raises(ValueError, match="multiple of 256"):
        backend_cls(8, 2, 128, 16, 0.1, torch.device("cpu"), torch.bfloat16)


def test_reference_rejects_calls_the_real_library_rejects():
    case = make_case(num_heads=4, num_kv_heads=2, head_dim=64, page=256, decode_ctx=[10], prompt_lens=[],
                     prefix_lens=[], device="cpu")
    q = case.q.unsqueeze(1)
    with pytest.raises(RuntimeError, match="int32"):
        flash_attn_reference.flash_attn_with_kvcache(
            q, case.k_cache, case.v_cache, cache_seqlens=case.metadata.seq_lens.long(),
            block_table=case.metadata.block_tables)
    with pytest.raises(RuntimeError, match="divisible by 256"):
        flash_attn_reference.flash_attn_with_kvcache(
            q, case.k_cache[:, :16], case.v_cache[:, :16], cache_seqlens=case.metadata.seq_lens,
            block_table=case.metadata.block_tables)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        flash_attn_reference.flash_attn_with_kvcache(
            q.float(), case.k_cache, case.v_cache, cache_seqlens=case.metadata.seq_lens,
            block_table=case.metadata.block_tables)


def test_decode_splits_default_to_flash_attn_heuristic_and_follow_the_switch(backend_cls, monkeypatch):
    """KVMESH_FA_DECODE_SPLITS (DECODE_SPLITS): 0 by default, flash-attn's own choice; N is passed
    as every decode's num_splits."""
    from kvmesh.worker.attention import flash_attn_backend

    case = make_case(num_heads=16, num_kv_heads=8, head_dim=128, page=256, decode_ctx=[300] * 16,
                     prompt_lens=[], prefix_lens=[], device="cpu")
    seen = []
    reference = flash_attn_reference.flash_attn_with_kvcache
    monkeypatch.setattr(flash_attn_reference, "flash_attn_with_kvcache",
                        lambda *a, **kw: seen.append(kw["num_splits"]) or reference(*a, **kw))
    backend = backend_cls(16, 8, 128, 256, case.scale, torch.device("cpu"), torch.bfloat16)
    for value in (flash_attn_backend.DECODE_SPLITS, 1):
        monkeypatch.setattr(flash_attn_backend, "DECODE_SPLITS", value)
        out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata)
        assert relative_error(out, reference_attention(case)) < 1e-2
    assert seen == [0, 1]
