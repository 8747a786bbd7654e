"""Each GPU attention backend against a float32 reference (and the torch backend where it exists)
on fresh random paged problems: mixed decode + prefill steps, cached prefixes, GQA 1/2/4/8,
head_dim 64 and 128, each backend's page sizes. Relative error must sit in the bf16 band."""

import importlib.util

import pytest
import torch

from attention_cases import make_case, reference_attention, relative_error
from kvmesh.worker.attention import load_backend_class
from kvmesh.worker.attention.registry import BACKENDS, backend_spec

pytestmark = pytest.mark.gpu

BF16_BAND = 1e-2  # bf16 operands land between 1e-3 and 1e-2; NaN fails the comparison
GPU_BACKENDS = [name for name, spec in BACKENDS.items() if spec.needs_gpu]  # torch: the second reference
# each backend's pages: those of these its registry line takes (flash_attn: 256), else its smallest
PAGES = {name: [p for p in (16, 1, 32, 256) if p % spec.block_size_multiple == 0] or [spec.block_size_multiple]
         for name, spec in BACKENDS.items()}


def backend_class(name):
    """The registry's class for `name` (an unknown name is a ValueError); skipped if its library is
    not installed here."""
    spec = backend_spec(name)
    if spec.library is not None and importlib.util.find_spec(spec.library) is None:
        pytest.skip(f"{spec.library} is not installed here")
    return load_backend_class(name)


def run(name, case, num_heads, num_kv_heads, head_dim, page):
    backend = backend_class(name)(num_heads, num_kv_heads, head_dim, page, case.scale,
                                  torch.device("cuda"), torch.bfloat16)
    backend.plan(case.metadata)
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata)
    torch.cuda.synchronize()
    return out


def torch_backend_output(case, num_heads, num_kv_heads, head_dim, page):
    try:
        from kvmesh.worker.attention.torch_backend import TorchAttentionBackend
    except ImportError:
        return None
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, page, case.scale, torch.device("cuda"),
                                    torch.bfloat16)
    backend.plan(case.metadata)
    return backend.forward(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(), case.metadata)


SHAPES = [(h, h // g, d) for g in (1, 2, 4, 8) for d in (64, 128) for h in (16,)]
CASES = {
    "mixed": dict(decode_ctx=[1, 37, 700], prompt_lens=[129, 1, 64], prefix_lens=[0, 300, 17]),
    "prefill_prefix": dict(decode_ctx=[], prompt_lens=[300, 77], prefix_lens=[512, 33]),
    "prefill_fresh": dict(decode_ctx=[], prompt_lens=[1000, 3], prefix_lens=[0, 0]),
    "decode": dict(decode_ctx=[5, 900, 64, 2049], prompt_lens=[], prefix_lens=[]),
    "decode_long_few": dict(decode_ctx=[8000], prompt_lens=[], prefix_lens=[]),
}


@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("kind", list(CASES))
def test_backend_matches_reference(name, num_heads, num_kv_heads, head_dim, kind):
    problem = BACKENDS[name].unsupported(PAGES[name][0], head_dim, "bfloat16")
    if problem is not None:
        pytest.skip(f"{name}: its registry line needs {problem[0]} to be {problem[1]}")
    for page in PAGES[name]:
        case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page=page,
                         seed=torch.randint(0, 2**31, ()).item(), **CASES[kind])
        ref = reference_attention(case)
        k_cache_before = case.k_cache.clone()
        out = run(name, case, num_heads, num_kv_heads, head_dim, page)
        err = relative_error(out, ref)
        assert err < BF16_BAND, f"{name} page={page}: relative error {err}"
        # the step's K/V landed in the pool at the slots, nothing else moved
        flat = case.k_cache.view(-1, num_kv_heads, head_dim)
        assert torch.equal(flat[case.metadata.slot_mapping], case.k)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
        untouched[case.metadata.slot_mapping] = False
        assert torch.equal(flat[untouched], k_cache_before.view(-1, num_kv_heads, head_dim)[untouched])
        torch_out = torch_backend_output(case, num_heads, num_kv_heads, head_dim, page)
        if torch_out is not None:
            assert relative_error(out, torch_out) < BF16_BAND


def test_triton_decode_split_counts_agree():
    from kvmesh.kernels.paged_decode import paged_decode
    case = make_case(num_heads=16, num_kv_heads=8, head_dim=128, page=16, decode_ctx=[1, 100, 3000, 5000],
                     prompt_lens=[], prefix_lens=[])
    ref = reference_attention(case)
    from kvmesh.kernels.store_kvcache import store_kvcache
    md = case.metadata
    store_kvcache(case.k, case.v, case.k_cache, case.v_cache, md.slot_mapping)
    for splits in (1, 2, 7, 16, 64):
        out = torch.full_like(case.q, float("nan"))
        paged_decode(case.q, case.k_cache, case.v_cache, out, md.seq_lens, md.block_tables, case.scale, splits)
        assert relative_error(out, ref) < BF16_BAND, splits


@pytest.mark.parametrize("chunk,block_n,num_warps,num_stages,grid", [
    (256, 64, 4, 2, 20), (512, 32, 4, 3, 10), (1024, 64, 8, 3, 5), (256, 32, 2, 3, 64)])
@pytest.mark.parametrize("page", [16, 256])
def test_triton_decode_in_chunks_of_keys(chunk, block_n, num_warps, num_stages, grid, page):
    # contexts of one chunk (written directly), of several, and grids wider than the longest needs
    from kvmesh.kernels.paged_decode import paged_decode
    from kvmesh.kernels.store_kvcache import store_kvcache
    case = make_case(num_heads=16, num_kv_heads=8, head_dim=128, page=page,
                     decode_ctx=[1, 100, 256, 257, 3000, 5000], prompt_lens=[], prefix_lens=[])
    ref = reference_attention(case)
    md = case.metadata
    store_kvcache(case.k, case.v, case.k_cache, case.v_cache, md.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    paged_decode(case.q, case.k_cache, case.v_cache, out, md.seq_lens, md.block_tables, case.scale, grid,
                 chunk=chunk, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    assert relative_error(out, ref) < BF16_BAND


def test_backend_class_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="attention_backend must be one of auto"):
        backend_class("not_a_backend")


def test_flash_attn_backend_rejects_page_16():
    cls = backend_class("flash_attn")
    with pytest.raises(ValueError, match="multiple of 256"):
        cls(16, 8, 128, 16, 0.1, torch.device("cuda"), torch.bfloat16)


def test_flashinfer_decodes_through_xqa_where_it_runs(monkeypatch):
    """With KVMESH_XQA_DECODE=1, XQA takes the decodes at pages of 16-128 on SM90+ with K/V in the
    model dtype; elsewhere, and by default, BatchDecode does. Both within the bf16 band."""
    cls = backend_class("flashinfer")
    from kvmesh.worker.attention import flashinfer_backend

    if torch.cuda.get_device_capability()[0] not in (9, 10, 12):
        pytest.skip("XQA runs on SM90 / SM100 / SM120")
    shape = dict(num_heads=16, num_kv_heads=8, head_dim=128)
    for page, xqa_on, expected in [(64, True, True), (128, True, True), (256, True, False), (64, False, False)]:
        monkeypatch.setattr(flashinfer_backend, "XQA_DECODE", xqa_on)
        case = make_case(page=page, decode_ctx=[3, 640, 2049, 129], prompt_lens=[200], prefix_lens=[64],
                         seed=page, **shape)
        backend = cls(16, 8, 128, page, case.scale, torch.device("cuda"), torch.bfloat16)
        assert backend.xqa is expected, (page, xqa_on)
        backend.plan(case.metadata)
        out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata)
        err = relative_error(out, reference_attention(case))
        assert err < BF16_BAND, f"page {page} xqa {expected}: relative error {err}"
    monkeypatch.setattr(flashinfer_backend, "XQA_DECODE", True)
    fp8 = cls(16, 8, 128, 64, 0.1, torch.device("cuda"), torch.bfloat16, kv_cache_dtype="fp8")
    assert not fp8.xqa  # its FP8 kernel is not verified here: BatchDecode reads FP8 K/V
