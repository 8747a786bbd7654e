"""Attention kernel timings on the GPU machine: each backend's paged decode and prefill against the
measured copy bandwidth and matmul rate. Prints a table; writes JSON to argv[1] if given.
Run: PYTHONPATH=. python3 bench/gpu_kernels.py $OUT/kernels.json
     PYTHONPATH=. python3 bench/gpu_kernels.py --fa-splits $OUT/fa_splits.json   flash-attn's decode
       over batch sizes and num_splits (0: its heuristic), the block table as wide as the engine's
       (max_model_len 4096 / page 256), timed as CUDA-graph replays
     PYTHONPATH=. python3 bench/gpu_kernels.py --decode-mix $OUT/decode_mix.json   decode kernels on
       uniform and mixed contexts (nano-vllm's 100-2,048): flash-attn, flashinfer's BatchDecode and its
       XQA (TensorRT-LLM's decode kernel) by page size, and kvmesh's Triton decode kernel (its splits
       by SM count, and in chunks of keys: KVMESH_DECODE_CHUNK's configurations), each against the
       float32 reference; flashinfer's rows only where it is installed. --decode-mix-pick prints the
       chunk configuration fastest over the mixed contexts at batches 128-256 (for a later run)
     PYTHONPATH=. python3 bench/gpu_kernels.py --sampler $OUT/sampler.json   the fused sampler
       (kernels/sample.py) on bf16 logits of Qwen3's 151,936 ids, sampled (T = 0.6) and greedy, by
       batch, as CUDA-graph replays against the copy rate over the logits' bytes
     PYTHONPATH=. python3 bench/gpu_kernels.py --gemm $OUT/gemm.json   the decoder's GEMMs at
       Qwen3-0.6B's shapes by tokens per step, cuBLAS against cuBLASLt (torch's preferred BLAS
       library), as CUDA-graph replays against the copy rate over the weights' bytes, each against
       a float32 product
     PYTHONPATH=. python3 bench/gpu_kernels.py --gemm-cold $OUT/gemm_cold.json   a layer's four GEMMs
       with their weights in L2 against L2 flushed before each (as between a decode step's layers)"""

import importlib.util
import json
import sys

import torch
import triton

sys.path.insert(0, "tests/gpu")
from attention_cases import make_case, reference_attention, relative_error  # noqa: E402

from kvmesh.bench.floor import measure_ceilings  # noqa: E402
from kvmesh.worker.attention.registry import block_size_for  # noqa: E402


def backend(name, h, hkv, d, page, scale):
    if name == "triton":
        from kvmesh.worker.attention.triton_backend import TritonAttentionBackend as cls
    elif name == "flashinfer":
        from kvmesh.worker.attention.flashinfer_backend import FlashInferAttentionBackend as cls
    else:
        from kvmesh.worker.attention.flash_attn_backend import FlashAttnAttentionBackend as cls
    return cls(h, hkv, d, page, scale, torch.device("cuda"), torch.bfloat16)


def time_attention(name, case, h, hkv, d, page):
    try:
        return _time_attention(name, case, h, hkv, d, page)
    except Exception as e:  # one backend failing must not hide the others' numbers
        print(f"{name} page {page}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return float("nan"), float("nan")


def _time_attention(name, case, h, hkv, d, page):
    b = backend(name, h, hkv, d, page, case.scale)
    b.plan(case.metadata)
    out = b.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata)
    err = relative_error(out, reference_attention(case))
    ms = triton.testing.do_bench(
        lambda: b.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.metadata),
        warmup=50, rep=300, return_mode="median")
    return ms, err


def main():
    ceilings = measure_ceilings(torch.device("cuda"))
    rows, results = [], {"ceilings": ceilings}
    bw, rate = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    h, hkv, d = 16, 8, 128
    available = ["triton"] + [n for n in ("flashinfer", "flash_attn") if importlib.util.find_spec(n)]
    decode_cases = [("decode 64x1024", 64, 1024), ("decode 256x600", 256, 600), ("decode 1x1024", 1, 1024),
                    ("decode 4x8192", 4, 8192)]
    for label, batch, ctx in decode_cases:
        for name in available:
            for page in sorted({block_size_for(name, p) for p in (16, 256)}):  # pages the backend takes
                case = make_case(num_heads=h, num_kv_heads=hkv, head_dim=d, page=page, decode_ctx=[ctx] * batch,
                                 prompt_lens=[], prefix_lens=[])
                ms, err = time_attention(name, case, h, hkv, d, page)
                kv_bytes = batch * ctx * hkv * d * 2 * 2
                rows.append((label, name, page, ms * 1e3, kv_bytes / (ms * 1e-3) / 1e12, kv_bytes / (ms * 1e-3) / bw, err))
    for label, batch, new, cached in [("prefill 64x256 on 768", 64, 256, 768), ("prefill 4x2048 fresh", 4, 2048, 0)]:
        for name in available:
            page = block_size_for(name)
            case = make_case(num_heads=h, num_kv_heads=hkv, head_dim=d, page=page, decode_ctx=[],
                             prompt_lens=[new] * batch, prefix_lens=[cached] * batch)
            ms, err = time_attention(name, case, h, hkv, d, page)
            # causal: each new token attends to cached + its position (+1)
            flops = 4 * h * d * batch * sum(cached + i + 1 for i in range(new))
            rows.append((label, name, page, ms * 1e3, flops / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / rate, err))
    results["rows"] = [dict(zip(("case", "backend", "page", "us", "TBps_or_TFLOPs", "of_ceiling", "rel_err"), r))
                       for r in rows]
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    print(f"{'case':24s} {'backend':10s} {'page':>4s} {'us':>9s} {'TB/s|TF/s':>9s} {'ceil%':>6s} {'relerr':>8s}")
    for r in rows:
        print(f"{r[0]:24s} {r[1]:10s} {r[2]:4d} {r[3]:9.1f} {r[4]:9.2f} {100 * r[5]:5.0f}% {r[6]:8.1e}", flush=True)


def save_rows(copy_bytes_per_s: float, rows: list[dict]):
    """A mode's rows as JSON to the path after the mode's flag, if one is given."""
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump({"copy_bytes_per_s": copy_bytes_per_s, "rows": rows}, f, indent=1)


def fa_splits():
    """Decode time of flash_attn_with_kvcache by batch, context and num_splits, the engine's shape."""
    from flash_attn import flash_attn_with_kvcache

    bw = measure_ceilings(torch.device("cuda"))["copy_bytes_per_s"]
    h, hkv, d, page, width = 16, 8, 128, 256, 16
    rows = []
    for ctx in (700, 1400):
        for batch in (8, 16, 32, 64, 96, 128, 192, 256):
            case = make_case(num_heads=h, num_kv_heads=hkv, head_dim=d, page=page, decode_ctx=[ctx] * batch,
                             prompt_lens=[], prefix_lens=[])
            m = case.metadata
            table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
            table[:, :m.block_tables.shape[1]] = m.block_tables
            q = case.q.unsqueeze(1)
            kv_bytes = batch * ctx * hkv * d * 2 * 2
            for splits in (0, 1, 2, 3, 4, 6, 8, 12, 16):
                def run():
                    return flash_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=m.seq_lens,
                                                   block_table=table, softmax_scale=case.scale, causal=True,
                                                   num_splits=splits)
                ms = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")
                rows.append(dict(ctx=ctx, batch=batch, splits=splits, us=ms * 1e3,
                                 of_copy=kv_bytes / (ms * 1e-3) / bw))
            case_rows = [r for r in rows if r["ctx"] == ctx and r["batch"] == batch]  # splits 0 first
            best = min(case_rows, key=lambda r: r["us"])
            line = " ".join(f"{r['splits']}:{r['us']:.0f}" for r in case_rows)
            print(f"ctx {ctx:5d} batch {batch:4d}  splits:us {line}  best {best['splits']} "
                  f"({best['of_copy']:.0%} of copy; heuristic {case_rows[0]['of_copy']:.0%})", flush=True)
    save_rows(bw, rows)


CHUNK_CONFIGS = [(256, 64, 4, 2), (256, 32, 4, 3), (256, 64, 4, 3), (512, 64, 4, 2), (512, 32, 4, 3),
                 (512, 64, 8, 3), (256, 32, 2, 3), (1024, 64, 4, 2)]  # chunk, block_n, num_warps, num_stages


def decode_mix(pages=(256, 128, 64, 32, 16)):
    """Decode kernels under CUDA graphs at the engine's shape, on uniform and on mixed contexts."""
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    from flash_attn import flash_attn_with_kvcache

    from kvmesh.kernels.paged_decode import choose_num_splits, paged_decode
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    bw = measure_ceilings(torch.device("cuda"))["copy_bytes_per_s"]
    h, hkv, d, max_len = 16, 8, 128, 4096
    workspace = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []

    def kernels(page, case, table):
        m, q = case.metadata, case.q
        out = {}
        if page == 256:
            out["flash_attn"] = lambda: flash_attn_with_kvcache(
                q.unsqueeze(1), case.k_cache, case.v_cache, cache_seqlens=m.seq_lens, block_table=table,
                softmax_scale=case.scale, causal=True).squeeze(1)
        tri_out = torch.empty_like(q)
        splits = choose_num_splits(q.shape[0], hkv, max_len, num_sms)
        out["triton"] = lambda: paged_decode(q, case.k_cache, case.v_cache, tri_out, m.seq_lens, table,
                                             case.scale, splits) or tri_out
        for chunk, block_n, warps, stages in CHUNK_CONFIGS:
            out[f"triton_c{chunk}_{block_n}_{warps}_{stages}"] = (
                lambda c=chunk, b=block_n, w=warps, st=stages: paged_decode(
                    q, case.k_cache, case.v_cache, tri_out, m.seq_lens, table, case.scale, max_len // c,
                    chunk=c, block_n=b, num_warps=w, num_stages=st) or tri_out)
        if flashinfer is None:
            return out
        if page in (16, 32, 64, 128):
            seq_lens = m.seq_lens.clone()
            xqa_out = torch.empty_like(q)
            out["xqa"] = lambda: flashinfer.decode.xqa_batch_decode_with_kv_cache(
                q, (case.k_cache, case.v_cache), workspace, table, seq_lens, max_len,
                bmm1_scale=case.scale, out=xqa_out)
        if page in (16, 256):
            lens = m.seq_lens_cpu
            pages = [-(-n // page) for n in lens]
            indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
            indices = torch.cat([m.block_tables[i, :p] for i, p in enumerate(pages)]).int()
            last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr.cuda(),
                paged_kv_indices_buffer=indices.cuda(), paged_kv_last_page_len_buffer=last.cuda())
            wrapper.plan(indptr, indices.cuda(), last, h, hkv, d, page, q_data_type=torch.bfloat16,
                         kv_data_type=torch.bfloat16, sm_scale=case.scale)
            fi_out = torch.empty_like(q)
            out["flashinfer"] = lambda: wrapper.run(q, (case.k_cache, case.v_cache), out=fi_out)
        return out

    for label, draw in (("ctx 1000", lambda b: [1000] * b),
                        ("ctx 100-2048", lambda b: torch.randint(100, 2049, (b,), generator=gen).tolist())):
        for batch in (16, 64, 128, 256):
            ctx = draw(batch)
            kv_bytes = sum(ctx) * hkv * d * 2 * 2
            for page in pages:
                case = make_case(num_heads=h, num_kv_heads=hkv, head_dim=d, page=page, decode_ctx=ctx,
                                 prompt_lens=[], prefix_lens=[])
                case.k_cache.view(-1, hkv, d)[case.metadata.slot_mapping] = case.k  # decode reads its own K/V
                case.v_cache.view(-1, hkv, d)[case.metadata.slot_mapping] = case.v
                ref = reference_attention(case)
                m = case.metadata
                table = torch.zeros(batch, max_len // page, dtype=torch.int32, device="cuda")
                table[:, :m.block_tables.shape[1]] = m.block_tables
                for name, run in kernels(page, case, table).items():
                    try:
                        err = relative_error(run(), ref)
                        ms = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")
                    except Exception as e:  # one kernel failing must not hide the others' numbers
                        print(f"{name} page {page}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                        continue
                    rows.append(dict(case=label, batch=batch, kernel=name, page=page, us=ms * 1e3,
                                     of_copy=kv_bytes / (ms * 1e-3) / bw, rel_err=err))
                    r = rows[-1]
                    print(f"{label:13s} batch {batch:4d} {name:22s} page {page:4d} {r['us']:8.1f} us "
                          f"{r['of_copy']:5.0%} of copy  err {err:.1e}", flush=True)
    save_rows(bw, rows)
    return rows


def decode_mix_pick():
    """The chunk configuration fastest over the mixed contexts at batches 128 and 256, page 256:
    printed last as KVMESH_DECODE_CHUNK's value."""
    rows = decode_mix(pages=(256,))
    mixed = [r for r in rows if r["case"] != "ctx 1000" and r["batch"] >= 128]
    total = {}
    for r in mixed:
        total[r["kernel"]] = total.get(r["kernel"], 0.0) + r["us"]
    for name, us in sorted(total.items(), key=lambda kv: kv[1]):
        print(f"mixed 128+256: {name:22s} {us:8.1f} us", flush=True)
    best = min((k for k in total if k.startswith("triton_c")), key=total.get)
    print(best.removeprefix("triton_c").replace("_", ","))


def sampler():
    """sample_from_logits' time by batch, temperature 0.6 and greedy: it reads each logit once."""
    from kvmesh.kernels.sample import sample_from_logits

    bw = measure_ceilings(torch.device("cuda"))["copy_bytes_per_s"]
    vocab, rows = 151_936, []
    for batch in (1, 32, 128, 256):
        logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
        for temperature in (0.6, 0.0):
            inv = torch.full((batch,), 1 / temperature if temperature else 0.0, device="cuda")
            ms = triton.testing.do_bench_cudagraph(lambda: sample_from_logits(logits, inv, 1234), rep=100,
                                                   return_mode="median")
            rows.append(dict(batch=batch, temperature=temperature, us=ms * 1e3,
                             of_copy=logits.numel() * 2 / (ms * 1e-3) / bw))
            print(f"batch {batch:4d} T {temperature:.1f}: {ms * 1e3:7.1f} us, "
                  f"{rows[-1]['of_copy']:.0%} of copy over the logits", flush=True)
    save_rows(bw, rows)


def gemm():
    """F.linear (the decoder's layers, worker/layers/parallel.py) at Qwen3-0.6B's shapes: small-M
    GEMMs read their weights once, so the floor is the weights' bytes at the copy rate."""
    import torch.nn.functional as F

    bw = measure_ceilings(torch.device("cuda"))["copy_bytes_per_s"]
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
              "lm_head": (151_936, 1024)}
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for name, (n, k) in shapes.items()}
    rows = []
    for tokens in (1, 8, 32, 64, 128, 192, 256, 512):
        line = []
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            layer_us = 0.0
            for name, w in weights.items():
                x = torch.randn(tokens, w.shape[1], device="cuda", dtype=torch.bfloat16)
                run = lambda: F.linear(x, w)  # noqa: E731
                err = ((run().float() - F.linear(x.float(), w.float())).abs().max()
                       / F.linear(x.float(), w.float()).abs().max()).item()
                ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
                rows.append(dict(tokens=tokens, library=library, gemm=name, us=ms * 1e3,
                                 of_copy=w.numel() * 2 / (ms * 1e-3) / bw, rel_err=err))
                layer_us += ms * 1e3 if name != "lm_head" else 0.0
            layer_bytes = sum(weights[n].numel() * 2 for n in ("qkv", "o", "gate_up", "down"))
            err = max(r["rel_err"] for r in rows if r["tokens"] == tokens and r["library"] == library)
            line.append(f"{library} layer {layer_us:6.1f} us ({layer_bytes / (layer_us * 1e-6) / bw:4.0%}) "
                        f"lm_head {rows[-1]['us']:6.1f} us ({rows[-1]['of_copy']:4.0%}) err {err:.0e}")
        print(f"tokens {tokens:4d}: " + " | ".join(line), flush=True)
    torch.backends.cuda.preferred_blas_library("default")
    save_rows(bw, rows)


def gemm_cold():
    """A decoder layer's four GEMMs with their weights in L2 (replayed back to back, as --gemm) and
    with L2 flushed first (a 256 MB fill before each GEMM, its own time subtracted), as in a decode
    step, where the attention kernel streams the KV through L2 between a layer's GEMMs: how much of
    a small-M GEMM's time is reading weights from HBM rather than L2."""
    import torch.nn.functional as F

    bw = measure_ceilings(torch.device("cuda"))["copy_bytes_per_s"]
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for name, (n, k) in shapes.items()}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush_ms = triton.testing.do_bench_cudagraph(lambda: flush.fill_(1), rep=50, return_mode="median")
    rows = []
    for tokens in (1, 8, 32, 64, 128, 256):
        hot_us = cold_us = 0.0
        for name, w in weights.items():
            x = torch.randn(tokens, w.shape[1], device="cuda", dtype=torch.bfloat16)
            hot = triton.testing.do_bench_cudagraph(lambda: F.linear(x, w), rep=50, return_mode="median")
            both = triton.testing.do_bench_cudagraph(lambda: (flush.fill_(1), F.linear(x, w)), rep=50,
                                                     return_mode="median")
            rows.append(dict(tokens=tokens, gemm=name, hot_us=hot * 1e3, cold_us=(both - flush_ms) * 1e3))
            hot_us += rows[-1]["hot_us"]
            cold_us += rows[-1]["cold_us"]
        layer_bytes = sum(w.numel() * 2 for w in weights.values())
        print(f"tokens {tokens:4d}: layer's 4 GEMMs, weights in L2 {hot_us:6.1f} us, L2 flushed {cold_us:6.1f} us "
              f"(copy rate over the weights: {layer_bytes / bw * 1e6:.1f} us; the fill {flush_ms * 1e3:.0f} us)",
              flush=True)
    save_rows(bw, rows)


if __name__ == "__main__":
    modes = {"--fa-splits": fa_splits, "--decode-mix": decode_mix, "--decode-mix-pick": decode_mix_pick,
             "--sampler": sampler, "--gemm": gemm, "--gemm-cold": gemm_cold}
    modes.get(sys.argv[1] if len(sys.argv) > 1 else "", main)()
