"""The norm-and-GEMM kernel (kvmesh.kernels.norm_gemm: a decoder layer's residual add, RMSNorm and
the GEMM after it, with SiLU-and-mul for gate_up, in one launch) on the CPU, under Triton's
interpreter (TRITON_INTERPRET=1 in a child process), against torch: in float32 the kernel's own
formula (the norm's weight on the operand, rstd after the product) to float32 rounding and the
decoder's unfused layers (RMSNorm, linear, SiLU-and-mul) to a few ulps; in bf16 the unfused layers
within the bf16 band. The residual stream it writes is x + residual exactly (in bf16 truncated, as
the interpreter casts; tests/unit/test_fused_norm_kernels.py says why). Shapes that cut every tile:
rows across row tiles, columns across column tiles, K not a multiple of the K step. Then the decoder
with the kernel in every layer it fits (forced on the CPU), against the decoder without it: the same
greedy tokens and logprobs on four architectures. On a GPU: tests/gpu/test_norm_gemm_gpu.py."""

import textwrap

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json, torch
    import torch.nn.functional as F
    from kvmesh.kernels.norm_gemm import norm_gemm, config_for
    from kvmesh.worker.layers.norm import RMSNorm

    def unfused(x, r, nw, eps, w, b, silu):  # the decoder's layers on the CPU (torch)
        norm = RMSNorm(x.shape[1], eps).to(x.dtype)
        norm.weight.data = nw
        normed, total = norm(x, r) if r is not None else (norm(x), x)
        y = F.linear(normed, w, b)
        if silu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate.float()).to(x.dtype) * up
        return y, total

    def formula(x, r, nw, eps, w, b, silu):  # the kernel's order of operations, in float64
        total = (x if r is None else x + r).double()
        rstd = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
        y = (total * nw.double()) @ w.double().T * rstd
        if b is not None:
            y = y + b.double()
        if silu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return y

    torch.manual_seed(0)
    out = {}
    K, N = 96, 80
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for rows in (1, 5, 37):
            for has_res in (False, True):
                for silu in (False, True):
                    for has_bias in ((False, True) if not silu else (False,)):
                        x = (torch.randn(rows, K) * 2).to(dtype)
                        r = torch.randn(rows, K).to(dtype) if has_res else None
                        nw = (1 + 0.3 * torch.randn(K)).to(dtype)
                        w = (torch.randn(2 * N if silu else N, K) / K ** 0.5).to(dtype)
                        b = torch.randn(N).to(dtype) if has_bias else None
                        # small tiles: 3 row tiles at 37 rows, 3 column tiles, K in steps of 32;
                        # then the shipped configuration (one K step wider than K: masked)
                        for cfg in ((16, 32, 32, 4, 1), None):
                            y, total = norm_gemm(x, r, nw, 1e-6, w, b, silu=silu, config=cfg)
                            key = f"{name}_m{rows}_res{int(has_res)}_silu{int(silu)}_bias{int(has_bias)}_{'small' if cfg else 'default'}"
                            ref, ref_total = unfused(x, r, nw, 1e-6, w, b, silu)
                            scale = ref.float().abs().max().item()
                            out[key + "_vs_unfused"] = (y.float() - ref.float()).abs().max().item() / scale
                            out[key + "_vs_formula"] = (y.double() - formula(x, r, nw, 1e-6, w, b, silu)).abs().max().item() / scale
                            if r is None:
                                exact = total is x
                            elif dtype == torch.bfloat16:  # the interpreter's cast: toward zero
                                exact = torch.equal(total, ((x.float() + r.float()).view(torch.int32) & -65536).view(torch.float32).to(dtype))
                            else:
                                exact = torch.equal(total, x + r)
                            out[key + "_total"] = bool(exact)
                            out[key + "_shape"] = list(y.shape)
    out["configs"] = [list(config_for(m)) for m in (1, 16, 17, 64, 65, 128, 129, 256)]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
    return run_interpreted(SCRIPT)


def test_float32_follows_its_formula_and_the_unfused_layers(result):
    keys = [k for k in result if k.startswith("float32_") and k.endswith("_vs_formula")]
    assert len(keys) == 3 * 2 * 3 * 2  # rows x residual x (plain, bias, silu) x configs
    for key in keys:
        assert result[key] < 1e-6, (key, result[key])
        # the unfused path rounds nothing in float32 either: only the sums' order differs
        assert result[key.replace("_vs_formula", "_vs_unfused")] < 1e-5, key


def test_bf16_is_within_the_band_of_the_unfused_layers(result):
    keys = [k for k in result if k.startswith("bfloat16_") and k.endswith("_vs_unfused")]
    assert len(keys) == 36
    for key in keys:
        # one bf16 operand rounded at another point, the interpreter's truncating casts: a few
        # units in bf16's 8 bits of mantissa, relative to the output's largest value
        assert result[key] < 4e-2, (key, result[key])


def test_the_residual_stream_is_written_whole_and_the_output_has_its_shape(result):
    for key, value in result.items():
        if key.endswith("_total"):
            assert value is True, key
        if key.endswith("_shape"):
            rows = int(key.split("_m")[1].split("_")[0])
            assert value == [rows, 80], key


def test_tiles_grow_with_the_rows(result):
    configs = result["configs"]
    assert [c[0] for c in configs] == [16, 16, 32, 64, 64, 64, 128, 128]
    assert all(c[0] in (16, 32, 64, 128) and c[1] % 16 == 0 and c[2] % 16 == 0 for c in configs)


ROTATE_SCRIPT = textwrap.dedent("""
    import json, torch
    from kvmesh.kernels.norm_gemm import norm_gemm, norm_qkv_rotate_store
    from kvmesh.kernels.rotary import rotate_and_store
    from kvmesh.worker.layers import rotary
    from kvmesh.worker.presets import hf_config_for

    torch.manual_seed(0)
    out = {}
    K, H, HKV, D = 96, 4, 2, 32
    emb = rotary.RotaryEmbedding(hf_config_for("qwen3-0.6b"), D, 256)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for rows in (3, 37):
            x = (torch.randn(rows, K) * 2).to(dtype)
            nw = (1 + 0.3 * torch.randn(K)).to(dtype)
            w = (torch.randn((H + 2 * HKV) * D, K) / K ** 0.5).to(dtype)
            positions = torch.randint(0, 256, (rows,))
            slots = torch.randperm(8 * 16)[:rows]
            slots[1] = -1  # CUDA-graph padding: nothing stored
            for has_res in (False, True):
                r = torch.randn(rows, K).to(dtype) if has_res else None
                for variant in ("plain", "bias", "head_norm", "fp8"):
                    b = torch.randn(w.shape[0]).to(dtype) if variant == "bias" else None
                    head_norm = ((1 + 0.2 * torch.randn(D)).to(dtype), (1 + 0.2 * torch.randn(D)).to(dtype), 1e-6) if variant == "head_norm" else None
                    cache_dtype = torch.float8_e4m3fn if variant == "fp8" else dtype
                    scales = (0.5, 2.0) if variant == "fp8" else (1.0, 1.0)
                    fused = [torch.zeros(8, 16, HKV, D, dtype=cache_dtype) for _ in range(2)]
                    apart = [torch.zeros(8, 16, HKV, D, dtype=cache_dtype) for _ in range(2)]
                    cfg = (16, 64, 32, 4, 1)  # 3 row tiles at 37 rows, K in 3 steps
                    q, total = norm_qkv_rotate_store(x, r, nw, 1e-6, w, b, H, HKV, positions, emb.cos, emb.sin,
                                                     *fused, slots, *scales, head_norm=head_norm, config=cfg)
                    qkv, ref_total = norm_gemm(x, r, nw, 1e-6, w, b, config=cfg)
                    qq, kk, vv = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
                    ref_q = rotate_and_store(positions, qq.view(rows, H, D), kk.view(rows, HKV, D), vv.view(rows, HKV, D),
                                             emb.cos, emb.sin, *apart, slots, *scales, norm=head_norm)
                    key = f"{name}_m{rows}_res{int(has_res)}_{variant}"
                    out[key + "_q"] = (q.float() - ref_q.float()).abs().max().item() / ref_q.float().abs().max().item()
                    out[key + "_cache"] = max((a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                                              for a, b in zip(fused, apart))
                    out[key + "_total"] = bool(torch.equal(total, ref_total))
                    # rows with a slot wrote theirs, the padding row and the slots of no row nothing
                    written = [bool(c.view(-1, HKV * D).float().abs().sum(-1)[s] > 0) for c in fused for s in slots.tolist() if s >= 0]
                    untouched = torch.ones(8 * 16, dtype=torch.bool)
                    untouched[slots[slots >= 0]] = False
                    out[key + "_slots"] = all(written) and all(bool(c.view(-1, HKV * D)[untouched].float().abs().sum() == 0) for c in fused)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def rotated():
    return run_interpreted(ROTATE_SCRIPT)


def test_the_rotation_form_equals_norm_gemm_then_rotate_and_store(rotated):
    """norm_qkv_rotate_store against its two parts (norm_gemm's qkv, then rotate_and_store), both
    under the interpreter: the head norm's sum runs in two halves here (the same float32 terms, another
    order), so float32 agrees to rounding, bf16 and FP8 to a unit of their last place."""
    assert len([k for k in rotated if k.endswith("_q")]) == 2 * 2 * 2 * 4
    for key, value in rotated.items():
        if key.endswith(("_total", "_slots")):
            assert value is True, key
            continue
        if key.startswith("float32") and "fp8" not in key:
            assert value < 1e-6, (key, value)
        elif "fp8" in key:
            assert value < 0.13, (key, value)  # e4m3: 3 bits of mantissa, 2^-3 a unit
        else:
            assert value < 2 ** -7, (key, value)  # a bf16 unit where the head norm's rstd moved


MODEL_SCRIPT = textwrap.dedent("""
    import json
    from kvmesh import LLM, SamplingParams
    from kvmesh.worker.models import decoder

    fits, used = decoder._norm_gemm_fits, []
    def forced(x, residual, norm, linear):  # the GPU's condition, less the device
        take = x.shape[0] <= 256 and decoder._norm_gemm_takes(x, residual, norm, linear)
        used.append((x.shape[0], residual is None, linear.weight.shape[0])) if take else None
        return take

    out = {}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    rotations = []
    project_store = decoder.Attention.norm_project_store
    def counted(self, *args):
        rotations.append(1)
        return project_store(self, *args)
    decoder.Attention.norm_project_store = counted
    for model in ("random:tiny-llama", "random:tiny-qwen2", "random:tiny-qwen3", "random:tiny-qwen3-moe"):
        runs = {}
        for arm in ("apart", "norm_gemm", "rotation_too"):
            decoder._norm_gemm_fits = fits if arm == "apart" else forced
            decoder.NORM_GEMM_ROTATE = arm == "rotation_too"
            used.clear()
            rotations.clear()
            llm = LLM(model, dtype="float32")
            prompts = [llm.encode("abc " * n) for n in (3, 9, 40)]
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            runs[arm] = [(o.token_ids, [max(t.values()) for t in o.top_logprobs]) for o in outs]
            if arm != "apart":
                out[f"{model}_{arm}"] = dict(
                    tokens_equal=[a[0] == b[0] for a, b in zip(runs["apart"], runs[arm])],
                    logprob_diff=max(abs(x - y) for a, b in zip(runs["apart"], runs[arm]) for x, y in zip(a[1], b[1])),
                    calls=len(used), first_layer_calls=sum(1 for u in used if u[1]),
                    widths=sorted({u[2] for u in used}), rotations=len(rotations))
    print(json.dumps(out))
""")


def test_the_decoder_with_the_kernel_gives_the_tokens_and_logprobs_of_the_separate_layers():
    """Both forms: the norm joining the qkv and gate_up GEMMs, and with the qkv launch also norming q / k
    heads, rotating and storing K / V (KVMESH_NORM_GEMM_ROTATE), against the separate layers."""
    result = run_interpreted(MODEL_SCRIPT)
    assert len(result) == 8
    for key, r in result.items():
        moe = "moe" in key
        assert r["tokens_equal"] == [True, True, True], (key, r)
        assert r["logprob_diff"] < 1e-4, (key, r)
        # every step (the three prompts' 208 tokens in one, then 11 decodes of 3) in every layer, twice
        # a layer but in Qwen3-MoE's sparse layer 0 (qkv only); the first layer's without a residual
        assert r["calls"] == 12 * (3 if moe else 4), (key, r)
        assert r["first_layer_calls"] == 12, (key, r)
        # the qkv launch of each layer and step took the rotation too, or none did
        assert r["rotations"] == (12 * 2 if key.endswith("rotation_too") else 0), (key, r)
    # qkv_proj's and gate_up_proj's widths: (4 q + 2 * kv heads) * head_dim, and 2 * intermediate;
    # Qwen3-MoE's sparse layer 0 keeps its own MLP, its dense layer 1 the fused gate_up
    assert result["random:tiny-llama_norm_gemm"]["widths"] == [(4 + 2 * 1) * 16, 2 * 128]
    assert result["random:tiny-qwen3_norm_gemm"]["widths"] == [(4 + 2 * 2) * 16, 2 * 128]
    assert result["random:tiny-qwen3-moe_norm_gemm"]["widths"] == [(4 + 2 * 2) * 16, 2 * 128]


@pytest.mark.parametrize("value,expected", [(None, "0"), ("0", "0"), ("256", "256"), ("-1", "ValueError"),
                                            ("many", "ValueError")])
def test_the_switch_is_off_unless_set_and_names_itself_when_malformed(value, expected):
    """KVMESH_NORM_GEMM_MAX_TOKENS, read once when the layers' module is imported."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KVMESH_NORM_GEMM_MAX_TOKENS"}
    if value is not None:
        env["KVMESH_NORM_GEMM_MAX_TOKENS"] = value
    out = subprocess.run([sys.executable, "-c", "from kvmesh.worker.layers.kernels import NORM_GEMM_MAX_TOKENS; "
                          "print(NORM_GEMM_MAX_TOKENS)"], env=env, capture_output=True, text=True, timeout=120)
    if expected == "ValueError":
        assert out.returncode != 0
        assert f"KVMESH_NORM_GEMM_MAX_TOKENS must be a whole number of tokens (0: off), got {value!r}" in out.stderr
    else:
        assert out.stdout.strip() == expected, out.stderr[-2000:]
