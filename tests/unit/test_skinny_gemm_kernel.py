"""kernels/skinny_gemm.py on the CPU: the product under Triton's interpreter (float32: the interpreter
has no bf16 dot; bf16 at Qwen3-0.6B's shapes runs in tests/gpu/test_skinny_gemm_gpu.py), and the
kernels compiled for sm_90 as the engine launches them: the GEMM loads its weight tile before
griddepcontrol.wait only when launched with PDL, and the kernels before it let it start early only
when KVMESH_SKINNY_GEMM is on."""

import re
import textwrap

import pytest
import torch

from tests.triton_aot import captured_launches, compile_sm90, unsupported
from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, torch
    from kvmesh.kernels.skinny_gemm import skinny_gemm, _buffers
    torch.manual_seed(0)
    out = {}
    cases = [(1, 96, 512, None), (5, 96, 512, None), (16, 64, 256, None), (70, 40, 768, None),
             (40, 96, 512, dict(block_n=32, slice_k=128, block_m=16, num_warps=4))]
    for m, n, k, cfg in cases:
        x, w = torch.randn(m, k), torch.randn(n, k) / k ** 0.5
        y = skinny_gemm(x, w, config=cfg)
        ref = x.double() @ w.double().T
        out[f"{m}x{n}x{k}"] = dict(err=((y.double() - ref).abs().max() / ref.abs().max()).item(),
                                   shape=list(y.shape), again=torch.equal(skinny_gemm(x, w, config=cfg), y))
    # a strided input (a row-major view with extra columns) and an empty one
    wide = torch.randn(9, 600)
    w = torch.randn(32, 512)
    out["strided"] = torch.allclose(skinny_gemm(wide[:, :512], w), wide[:, :512] @ w.T, atol=1e-4)
    out["empty"] = list(skinny_gemm(torch.randn(0, 256), torch.randn(32, 256)).shape)
    out["counts"] = int(next(iter(_buffers.values())).counts.abs().sum())
    try:
        skinny_gemm(torch.randn(2, 512), torch.randn(32, 512), config=dict(block_n=32, slice_k=384, block_m=16,
                                                                            num_warps=4))
    except ValueError as e:
        out["bad_slice"] = str(e)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
    return run_interpreted(SCRIPT)


def test_the_product_matches_float64_in_one_slice_and_in_split_k(result):
    for key in ("1x96x512", "5x96x512", "16x64x256", "70x40x768", "40x96x512"):  # splits 2, 2, 1, 3, 4
        m, n, _ = map(int, key.split("x"))
        assert result[key]["shape"] == [m, n]
        assert result[key]["err"] < 1e-5, (key, result[key])
        assert result[key]["again"]  # partials added in split order: the same bits every run


def test_strided_and_empty_inputs_and_every_tile_count_reset(result):
    assert result["strided"] is True
    assert result["empty"] == [0, 32]
    assert result["counts"] == 0  # the last program of each tile reset its count for the next launch
    assert "slice_k 384" in result["bad_slice"] and "512" in result["bad_slice"]


def test_off_by_default_and_never_on_the_cpu(monkeypatch):
    from kvmesh.kernels import skinny_gemm as sg

    x, w = torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(32, 256, dtype=torch.bfloat16)
    assert not sg.ENABLED  # KVMESH_SKINNY_GEMM unset
    assert not sg.applies(x, w) and not sg.launch_next(x.device)
    monkeypatch.setattr(sg, "ENABLED", True)
    assert not sg.applies(x, w)  # a CPU tensor
    assert not sg.use_pdl(torch.device("cpu")) and not sg.launch_next(torch.device("cpu"))


needs_aot = pytest.mark.skipif(unsupported() is not None, reason=str(unsupported()))
BF = torch.bfloat16
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def _compiled(call):
    with captured_launches() as launches:
        call()
    assert len(launches) >= 1
    return compile_sm90(launches[-1])


@needs_aot
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_gemm_loads_its_weight_before_the_wait_only_with_pdl(name, rows):
    from kvmesh.kernels.skinny_gemm import default_config, skinny_gemm

    n, k = SHAPES[name]
    x, w = torch.randn(rows, k, dtype=BF), torch.randn(n, k, dtype=BF)
    cfg = default_config(rows, n, k)
    early = _compiled(lambda: skinny_gemm(x, w, pdl=True))
    assert early.spill_bytes == 0 and early.shared <= 64 * 1024, early.shared  # several programs an SM
    lines = early.ptx.splitlines()
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert len(wait) == 1
    loads_before = [line for line in lines[:wait[0]] if re.search(r"\bld\.global", line)]
    # the weight tile: block_n x slice_k bf16 over 128 threads in 16-byte loads, all before the wait
    assert len(loads_before) == cfg["block_n"] * cfg["slice_k"] * 2 // (128 * 16)
    assert "griddepcontrol.launch_dependents" not in early.ptx  # it starts nothing early itself
    assert "griddepcontrol" not in _compiled(lambda: skinny_gemm(x, w, pdl=False)).ptx


@needs_aot
@pytest.mark.parametrize("kernel", ["rms_norm", "add_rms_norm", "silu_and_mul", "merge_splits"])
def test_the_kernels_before_it_start_it_early_only_when_it_is_on(monkeypatch, kernel):
    from kvmesh.kernels import paged_decode, rms_norm, silu_and_mul

    def launch():
        if kernel == "rms_norm":
            rms_norm.rms_norm(torch.randn(8, 1024, dtype=BF), torch.ones(1024, dtype=BF), 1e-6)
        elif kernel == "add_rms_norm":
            x = torch.randn(8, 1024, dtype=BF)
            rms_norm.add_rms_norm(x, x.clone(), torch.ones(1024, dtype=BF), 1e-6)
        elif kernel == "silu_and_mul":
            silu_and_mul.silu_and_mul(torch.randn(8, 6144, dtype=BF))
        else:  # the decode's split merge (its last launch), chunk mode as the engine runs it
            q = torch.randn(8, 16, 128, dtype=BF)
            cache = torch.zeros(4, 256, 8, 128, dtype=BF)
            paged_decode.paged_decode(q, cache, cache, torch.empty_like(q), torch.full((8,), 600, dtype=torch.int32),
                                      torch.zeros(8, 4, dtype=torch.int32), 0.088, 4, chunk=512)

    for module in (rms_norm, silu_and_mul, paged_decode):
        monkeypatch.setattr(module, "launch_next", lambda device: True)
    assert "griddepcontrol.launch_dependents" in _compiled(launch).ptx
    for module in (rms_norm, silu_and_mul, paged_decode):
        monkeypatch.setattr(module, "launch_next", lambda device: False)
    assert "griddepcontrol" not in _compiled(launch).ptx
