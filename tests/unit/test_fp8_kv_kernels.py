"""The Triton kernels' FP8 KV paths (kvmesh.kernels.store_kvcache, paged_decode, paged_prefill) on
the CPU, under Triton's interpreter (TRITON_INTERPRET=1, in a child process: the variable must be
set before triton is imported), at tiny sizes. At full size on a GPU: tests/gpu/test_fp8_kv_cache_gpu.py.

Two limits of the interpreter (Triton 3.x, seen here) shape these tests: its float32 -> e4m3 cast
rounds ties away from zero and drops the carry of a value that rounds up to the next power of two
(1.99 -> 1.0), where a GPU rounds to nearest even as torch does; and its bf16 tl.dot gives garbage
(the bf16 kernels without FP8 too). So the store is checked on values that round down (no tie, no
carry): placement, scaling, clamping and skipping, not the hardware's rounding (the GPU test checks
the bytes); and the attention kernels run in float32 over a pool the torch path wrote.
"""

import textwrap

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, "tests/gpu")
    from attention_cases import fp8_case, make_case, relative_error
    from kvmesh.kernels.paged_decode import paged_decode
    from kvmesh.kernels.paged_prefill import paged_prefill
    from kvmesh.kernels.store_kvcache import store_kvcache
    from kvmesh.worker.attention.torch_backend import TorchAttentionBackend, store_kvcache_torch

    out = {}
    gen = torch.Generator().manual_seed(0)
    # store: e4m3 values (all 126 finite positive ones and their negatives, beyond-range values),
    # nudged up by less than a quarter step, times the scale; slot -1 skipped
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.cat([e4m3, -e4m3, torch.tensor([600.0, -1e4, 0.0, 449.0])])
    grid = grid * (1 + torch.rand(grid.shape, generator=gen) * 2 ** -6)
    for dtype in (torch.float32, torch.bfloat16):
        for k_scale, v_scale in ((1.0, 1.0), (0.5, 4.0)):
            x = grid[torch.randperm(256, generator=gen)].view(8, 2, 16)  # [T, Hkv, D]
            k, v = (x * k_scale).to(dtype), (x.flip(0) * v_scale).to(dtype)
            slots = torch.tensor([5, 0, 9, -1, 30, 31, 12, 2])
            pools = [torch.zeros(8, 4, 2, 16, dtype=torch.float8_e4m3fn) for _ in range(4)]
            store_kvcache(k, v, pools[0], pools[1], slots, k_scale, v_scale)
            store_kvcache_torch(k, v, pools[2], pools[3], slots, k_scale, v_scale)
            name = f"store_{str(dtype).removeprefix('torch.')}_{k_scale}"
            out[name] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                            for a, b in ((pools[0], pools[2]), (pools[1], pools[3])))
    # attention: a mixed decode + prefill step over an FP8 pool, float32 queries
    H, HKV, D, PAGE = 4, 2, 16, 4
    K_SCALE, V_SCALE = 0.5, 2.0
    case = make_case(num_heads=H, num_kv_heads=HKV, head_dim=D, page=PAGE, dtype=torch.float32, device="cpu",
                     seed=5, decode_ctx=[1, 9, 70], prompt_lens=[7, 1, 20], prefix_lens=[0, 5, 17])
    fp8, solved = fp8_case(case, K_SCALE, V_SCALE)
    md = fp8.metadata
    k_cache, v_cache = fp8.k_cache.clone(), fp8.v_cache.clone()
    torch_backend = TorchAttentionBackend(H, HKV, D, PAGE, case.scale, torch.device("cpu"), torch.float32,
                                          kv_cache_dtype="fp8")
    ref = torch_backend.forward(fp8.q, fp8.k, fp8.v, k_cache, v_cache, md, K_SCALE, V_SCALE)
    out["torch_vs_solved"] = relative_error(ref, solved)
    n = md.num_decode_tokens
    for splits in (1, 3):
        o = torch.zeros_like(fp8.q)
        paged_decode(fp8.q[:n], k_cache, v_cache, o[:n], md.seq_lens[:n], md.block_tables[:n],
                     case.scale, splits, K_SCALE, V_SCALE)
        out[f"decode_{splits}"] = relative_error(o[:n], ref[:n])
    # splits of a fixed number of keys (chunk): contexts 1, 9 and 70 take 1, 1 and 5 splits of 16 or
    # 1, 1 and 3 of 32; a grid of 8 leaves programs past each context's splits with nothing to do
    for chunk, splits in ((16, 5), (32, 8)):
        o = torch.zeros_like(fp8.q)
        paged_decode(fp8.q[:n], k_cache, v_cache, o[:n], md.seq_lens[:n], md.block_tables[:n],
                     case.scale, splits, K_SCALE, V_SCALE, chunk=chunk, block_n=16)
        out[f"decode_chunk{chunk}"] = relative_error(o[:n], ref[:n])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()  # the torch forward stores the step's K / V in them
    plain_ref = TorchAttentionBackend(H, HKV, D, PAGE, case.scale, torch.device("cpu"), torch.float32).forward(
        case.q, case.k, case.v, kc, vc, case.metadata)
    o = torch.zeros_like(case.q)
    paged_decode(case.q[:n], kc, vc, o[:n], case.metadata.seq_lens[:n],
                 case.metadata.block_tables[:n], case.scale, 5, chunk=16, block_n=16)
    out["decode_chunk16_bf16_free"] = relative_error(o[:n], plain_ref[:n])
    o = torch.zeros_like(fp8.q)
    paged_prefill(fp8.q, k_cache, v_cache, o, md.query_start_loc, md.seq_lens, md.block_tables,
                  md.max_query_len, case.scale, K_SCALE, V_SCALE, first_seq=n)
    out["prefill"] = relative_error(o[n:], ref[n:])
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
    return run_interpreted(SCRIPT)


@pytest.mark.parametrize("case", ["store_float32_1.0", "store_float32_0.5", "store_bfloat16_1.0",
                                  "store_bfloat16_0.5"])
def test_store_kernel_writes_the_bytes_the_torch_path_writes(result, case):
    assert result[case]  # K / k_scale and V / v_scale clamped to +-448, at their slots, slot -1 skipped


@pytest.mark.parametrize("kernel", ["decode_1", "decode_3", "decode_chunk16", "decode_chunk32", "prefill"])
def test_attention_kernels_read_the_fp8_pool_as_the_torch_backend(result, kernel):
    # the same FP8 values and scales, float32 arithmetic on both sides
    assert result[kernel] < 1e-5
    assert result["torch_vs_solved"] < 1e-5


def test_decode_in_chunks_of_keys_on_a_float32_pool(result):
    assert result["decode_chunk16_bf16_free"] < 1e-5  # no FP8: the same splits and merge
