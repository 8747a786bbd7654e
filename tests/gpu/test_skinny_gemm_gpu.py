"""kernels/skinny_gemm.py on the GPU: the product at Qwen3-0.6B's decode shapes against a float32
reference, with and without programmatic dependent launch, eagerly and as a CUDA graph after a kernel
that lets it start early; the same bits on every run (the split-K partials are added in split order);
and a model's greedy tokens and logprobs with the kernel in its linear layers against cuBLAS."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import skinny_gemm as sg
from kvmesh.kernels.rms_norm import add_rms_norm
from kvmesh.kernels.silu_and_mul import silu_and_mul
from kvmesh.worker.attention.registry import block_size_for
from qwen3_greedy import generate_greedy
from test_greedy_qwen3 import NEAR_TIE_NATS

pytestmark = pytest.mark.gpu

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 128, 256])
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("pdl", [False, True])
def test_product_matches_float32_and_repeats_bit_for_bit(name, rows, pdl):
    n, k = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    y = sg.skinny_gemm(x, w, pdl=pdl)
    ref = x.float() @ w.float().T
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert rel_err(y, ref) < 8e-3  # bf16 output rounding
    assert rel_err(F.linear(x, w), ref) < 8e-3
    for _ in range(3):
        assert torch.equal(sg.skinny_gemm(x, w, pdl=pdl), y)
    assert int(sg._buffers[x.device].counts.abs().sum()) == 0  # every tile's count reset


@pytest.mark.parametrize("rows", [8, 200])
def test_early_start_in_a_cuda_graph_reads_the_kernel_befores_output(monkeypatch, rows):
    """add + RMSNorm, then the qkv GEMM, SiLU-and-mul then the down GEMM, captured and replayed with
    new inputs each time: a GEMM that read its input before the kernel before it finished would
    return the previous replay's product."""
    monkeypatch.setattr(sg, "ENABLED", True)
    assert sg.launch_next(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    residual = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    norm_w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 6144, device="cuda", generator=g).bfloat16()
    w_qkv = (torch.randn(4096, 1024, device="cuda", generator=g) / 32).bfloat16()
    w_down = (torch.randn(1024, 3072, device="cuda", generator=g) / 55).bfloat16()

    def step():
        normed, _ = add_rms_norm(hidden, residual, norm_w, 1e-6)
        return sg.skinny_gemm(normed, w_qkv, pdl=True), sg.skinny_gemm(silu_and_mul(gate_up), w_down, pdl=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv, down = step()
    for _ in range(5):
        hidden.copy_(torch.randn(rows, 1024, device="cuda", generator=g))
        gate_up.copy_(torch.randn(rows, 6144, device="cuda", generator=g))
        graph.replay()
        normed, _ = add_rms_norm(hidden, residual, norm_w, 1e-6)
        assert torch.equal(qkv, sg.skinny_gemm(normed, w_qkv, pdl=False))
        assert torch.equal(down, sg.skinny_gemm(silu_and_mul(gate_up), w_down, pdl=False))


@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_a_models_greedy_tokens_with_the_kernel_match_cublas(monkeypatch, backend):
    """The decode steps' linear layers (CUDA graphs, up to MAX_ROWS rows) through skinny_gemm, the
    kernels before them starting it early, against F.linear: the same greedy tokens, or a divergence
    only at a near-tie of the cuBLAS run (as test_greedy_qwen3.py)."""
    base = generate_greedy(backend, block_size=block_size_for(backend), logprobs=8)
    monkeypatch.setattr(sg, "ENABLED", True)
    calls = []
    original = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda *a, **k: calls.append(1) or original(*a, **k))
    outs = generate_greedy(backend, block_size=block_size_for(backend), logprobs=8)
    assert calls  # the kernel ran (captured into the decode graphs)
    for ref, out in zip(base, outs):
        if out.token_ids == ref.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b)
        gap = max(ref.top_logprobs[i].values()) - ref.top_logprobs[i].get(out.token_ids[i], float("-inf"))
        assert gap < NEAR_TIE_NATS, (i, gap)
