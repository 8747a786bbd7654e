"""The fused kernels (kvmesh.kernels.rms_norm.add_rms_norm: the residual add and its RMSNorm;
kvmesh.kernels.rotary.apply_qk_norm_rotary: Qwen3's q / k norms and the rotation;
kvmesh.kernels.rotary.rotate_and_store: the rotation writing K / V into the paged cache) on the CPU,
under Triton's interpreter (TRITON_INTERPRET=1 in a child process): bit for bit the separate kernels
they replace, and within float32 rounding of the torch layers. On a GPU: tests/gpu/test_fused_kernels.py.

The interpreter casts float32 to bf16 toward zero (a GPU, like torch, rounds to nearest even), so on
bf16 the fused add's sum is checked against x + r truncated to bf16, the interpreter's own cast; the
GPU test checks it against torch's add."""

import textwrap

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, torch
    from kvmesh.kernels.rms_norm import add_rms_norm, rms_norm
    from kvmesh.kernels.rotary import apply_qk_norm_rotary, apply_rotary
    from kvmesh.worker.layers import rotary
    from kvmesh.worker.layers.norm import RMSNorm
    from kvmesh.worker.presets import hf_config_for

    out = {}
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        # the residual add and its norm, hidden 96 (not a power of two: masked lanes)
        x, r = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
        w = torch.randn(96).to(dtype)
        normed, total = add_rms_norm(x, r, w, 1e-6)
        exact = x.float() + r.float()
        if dtype == torch.bfloat16:  # the interpreter's cast: toward zero (the high 16 bits)
            expected = (exact.view(torch.int32) & -65536).view(torch.float32).to(dtype)
        else:
            expected = x + r
        out[f"add_{name}_bits"] = torch.equal(total, expected) and torch.equal(normed, rms_norm(total, w, 1e-6))
        layer = RMSNorm(96, 1e-6).to(dtype)
        layer.weight.data = w
        ref_normed, ref_total = layer(x, r)  # the torch path
        out[f"add_{name}_vs_torch"] = max((normed.float() - ref_normed.float()).abs().max().item(),
                                          (total.float() - ref_total.float()).abs().max().item())
        # q / k norms and rotation over strided views of a qkv row, as the decoder splits them
        emb = rotary.RotaryEmbedding(hf_config_for("qwen3-0.6b"), 32, 64)
        qkv = torch.randn(5, (4 + 2 * 2) * 32).to(dtype)
        q, k = qkv[:, :128].view(5, 4, 32), qkv[:, 128:192].view(5, 2, 32)
        wq, wk = torch.randn(32).to(dtype), torch.randn(32).to(dtype)
        positions = torch.tensor([0, 3, 17, 63, 8])
        fq, fk = apply_qk_norm_rotary(positions, q, k, wq, wk, 1e-6, emb.cos, emb.sin)
        sq, sk = apply_rotary(positions, rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6), emb.cos, emb.sin)
        out[f"qk_{name}_bits"] = torch.equal(fq, sq) and torch.equal(fk, sk)
        qn, kn = RMSNorm(32, 1e-6).to(dtype), RMSNorm(32, 1e-6).to(dtype)
        qn.weight.data, kn.weight.data = wq, wk
        rq, rk = emb(positions, qn(q), kn(k))  # the torch path
        out[f"qk_{name}_vs_torch"] = max((fq.float() - rq.float()).abs().max().item(),
                                         (fk.float() - rk.float()).abs().max().item())
        # the rotation storing K / V into a paged cache, normed or not, with a padding slot (-1)
        from kvmesh.kernels.rotary import rotate_and_store
        from kvmesh.kernels.store_kvcache import store_kvcache
        v = qkv[:, 192:].view(5, 2, 32)
        slots = torch.tensor([9, 2, -1, 15, 0])
        for norm in (None, (wq, wk, 1e-6)):
            for cache_dtype in (dtype, torch.float8_e4m3fn):
                fused = [torch.zeros(4, 4, 2, 32, dtype=cache_dtype) for _ in range(2)]
                apart = [torch.zeros(4, 4, 2, 32, dtype=cache_dtype) for _ in range(2)]
                fq = rotate_and_store(positions, q, k, v, emb.cos, emb.sin, *fused, slots, 0.5, 2.0, norm=norm)
                if norm is None:
                    sq, sk = apply_rotary(positions, q, k, emb.cos, emb.sin)
                else:
                    sq, sk = apply_qk_norm_rotary(positions, q, k, *norm, emb.cos, emb.sin)
                store_kvcache(sk, v, *apart, slots, 0.5, 2.0)
                key = f"store_{name}_{'norm' if norm else 'plain'}_{str(cache_dtype).removeprefix('torch.')}"
                out[key] = (torch.equal(fq, sq) and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                                          for a, b in zip(fused, apart))
                            and bool(fused[0].float().abs().sum() > 0))
        # heads grouped per program (kvmesh.kernels.rotary.heads_per_program: 8 for prompt chunks):
        # 4 a program over 4 q + 2 k heads mixes q and k in one program and leaves two slots past
        # the last head; the same bits as one head a program, K / V stored alike
        from kvmesh.kernels.rotary import _launch
        # and the heads as the rows of one tile (KVMESH_ROTARY_ROWS, an experiment: 4 rows over the
        # 6 heads, 2 over them)
        runs = []
        for heads, rows in ((1, 0), (4, 0), (None, 4), (None, 2)):
            cache = [torch.zeros(4, 4, 2, 32, dtype=dtype) for _ in range(2)]
            plain = _launch(positions, q, k, emb.cos, emb.sin, norm=(wq, wk, 1e-6), heads=heads, rows=rows)
            stored = _launch(positions, q, k, emb.cos, emb.sin, norm=(wq, wk, 1e-6),
                             store=(v, *cache, slots, 1.0, 1.0), heads=heads, rows=rows)[0]
            runs.append((plain, stored, cache))
        (p1, s1, c1), *others = runs
        for label, (p4, s4, c4) in zip(("grouped", "rows4", "rows2"), others):
            out[f"{label}_{name}_bits"] = (torch.equal(p1[0], p4[0]) and torch.equal(p1[1], p4[1])
                                           and torch.equal(s1, s4) and all(torch.equal(a, b) for a, b in zip(c1, c4)))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
    return run_interpreted(SCRIPT)


@pytest.mark.parametrize("name", ["add_float32_bits", "add_bfloat16_bits", "qk_float32_bits", "qk_bfloat16_bits",
                                  "grouped_float32_bits", "grouped_bfloat16_bits", "rows4_float32_bits",
                                  "rows4_bfloat16_bits", "rows2_float32_bits", "rows2_bfloat16_bits"])
def test_fused_kernel_equals_the_separate_kernels_bit_for_bit(result, name):
    assert result[name] is True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm", ["plain", "norm"])
@pytest.mark.parametrize("cache", ["model", "float8_e4m3fn"])
def test_rotation_that_stores_kv_writes_the_bytes_of_the_rotation_then_store_kvcache(result, dtype, norm, cache):
    """rotate_and_store's q equals the rotation's, and its cache the store kernel's after it, byte for
    byte, in the model's dtype and in FP8 (scales 0.5 and 2.0), skipping the padding slot."""
    assert result[f"store_{dtype}_{norm}_{dtype if cache == 'model' else cache}"] is True


def test_fused_kernels_match_the_torch_layers_in_float32(result):
    # float32 throughout: only the order of the norm's sum differs from torch's mean
    assert result["add_float32_vs_torch"] < 1e-5
    assert result["qk_float32_vs_torch"] < 1e-5


@pytest.mark.parametrize("variable,flag", [("KVMESH_FUSED_NORMS", "FUSE_NORMS"),
                                           ("KVMESH_FUSED_KV_STORE", "FUSE_KV_STORE")])
@pytest.mark.parametrize("value,fused", [(None, True), ("1", True), ("0", False)])
def test_the_fusion_switches_set_to_0_keep_the_kernels_apart(variable, flag, value, fused):
    """The A/B switches docs/PERF.md names: read once when the layers' module is imported."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    out = subprocess.run([sys.executable, "-c", f"from kvmesh.worker.layers.kernels import {flag}; "
                          f"print({flag})"], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(fused), out.stderr[-2000:]


@pytest.mark.parametrize("value,on", [(None, False), ("0", False), ("1", True)])
def test_the_xqa_switch_is_off_unless_set_to_1(value, on):
    """KVMESH_XQA_DECODE (docs/PERF.md): read once when the flashinfer backend's module is imported;
    off by default. Even on, a CPU device never takes the XQA path."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KVMESH_XQA_DECODE"}
    if value is not None:
        env["KVMESH_XQA_DECODE"] = value
    code = ("import torch; from kvmesh.worker.attention import flashinfer_backend as f; "
            "print(f.XQA_DECODE, f.xqa_supported(torch.device('cpu'), 64, 128, torch.bfloat16, torch.bfloat16))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [str(on), "False"], out.stderr[-2000:]


def test_prompt_chunks_take_eight_heads_a_program_decode_steps_one(monkeypatch):
    """...and decode steps of 64 tokens or more four heads a program as the rows of one tile."""
    from kvmesh.kernels import rotary

    monkeypatch.setattr(rotary, "FIXED_HEADS", 0)
    assert [rotary.heads_per_program(n) for n in (1, 256, 2047, 2048, 16384)] == [1, 1, 1, 8, 8]
    assert [rotary.rows_per_program(n) for n in (1, 63, 64, 256, 2047, 2048)] == [0, 0, 4, 4, 4, 0]
    monkeypatch.setattr(rotary, "ROWS", 0)  # KVMESH_ROTARY_ROWS=0
    assert rotary.rows_per_program(256) == 0
    monkeypatch.setattr(rotary, "FIXED_HEADS", 4)  # KVMESH_ROTARY_HEADS=4
    assert rotary.heads_per_program(1) == rotary.heads_per_program(16384) == 4
