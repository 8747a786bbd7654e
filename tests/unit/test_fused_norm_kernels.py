"""The fused norm kernels (kvmesh.kernels.rms_norm.add_rms_norm: the residual add and its RMSNorm;
kvmesh.kernels.rotary.apply_qk_norm_rotary: Qwen3's q / k norms and the rotation) on the CPU, under
Triton's interpreter (TRITON_INTERPRET=1 in a child process): bit for bit the separate kernels they
replace, and within float32 rounding of the torch layers. On a GPU: tests/gpu/test_fused_kernels.py.

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
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
    return run_interpreted(SCRIPT)


@pytest.mark.parametrize("name", ["add_float32_bits", "add_bfloat16_bits", "qk_float32_bits", "qk_bfloat16_bits"])
def test_fused_kernel_equals_the_separate_kernels_bit_for_bit(result, name):
    assert result[name] is True


def test_fused_kernels_match_the_torch_layers_in_float32(result):
    # float32 throughout: only the order of the norm's sum differs from torch's mean
    assert result["add_float32_vs_torch"] < 1e-5
    assert result["qk_float32_vs_torch"] < 1e-5


@pytest.mark.parametrize("value,fused", [(None, True), ("1", True), ("0", False)])
def test_kvmesh_fused_norms_0_keeps_the_kernels_apart(value, fused):
    """The A/B switch docs/PERF.md names: read once when the layers' module is imported."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KVMESH_FUSED_NORMS"}
    if value is not None:
        env["KVMESH_FUSED_NORMS"] = value
    out = subprocess.run([sys.executable, "-c", "from kvmesh.worker.layers.kernels import FUSE_NORMS; "
                          "print(FUSE_NORMS)"], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(fused), out.stderr[-2000:]
