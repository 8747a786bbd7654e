"""`kvmesh bench latency`: TPOT at batch 1 (median gap between streamed tokens) and TTFT of a
1024-token prompt (median over fresh random prompts, so the prefix cache never hits)."""

import json
import random
import statistics
import time

from kvmesh.bench.offline import DEFAULT_MODEL
from kvmesh.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES


def add_arguments(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--attention-backend", default="auto",
                   choices=ATTENTION_BACKENDS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model dtype; fp8 / fp8_e4m3: an FP8 KV cache")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size (default 16, rounded up to the backend's block_size_multiple)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: the linear layers' weights in FP8 (e4m3, per-tensor scales), as vLLM's")
    p.add_argument("--torch-compile", action="store_true",
                   help="torch.compile the layers' work outside attention")
    p.add_argument("--prompt-len", type=int, default=1024, help="TTFT prompt length (default 1024)")
    p.add_argument("--decode-prompt-len", type=int, default=128, help="prompt before the TPOT decode")
    p.add_argument("--output-len", type=int, default=256, help="tokens decoded for TPOT (default 256)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from kvmesh import LLM, SamplingParams
    from kvmesh.worker.attention.registry import block_size_for

    if min(args.prompt_len, args.decode_prompt_len, args.output_len, args.repeats) < 1 or args.output_len < 2:
        raise ValueError("lengths and --repeats must be >= 1 (--output-len >= 2)")
    block_size = args.block_size or block_size_for(args.attention_backend)
    llm = LLM(model=args.model, device=args.device, attention_backend=args.attention_backend,
              block_size=block_size, enforce_eager=args.enforce_eager, max_num_seqs=8,
              torch_compile=args.torch_compile, tensor_parallel_size=args.tensor_parallel_size,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              max_num_batched_tokens=max(2048, args.prompt_len),
              max_model_len=max(4096, args.prompt_len + 8, args.decode_prompt_len + args.output_len + 8))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(min(vocab, 10000)) for _ in range(n)]

    def stream_times(ids, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        times = [time.perf_counter() for delta in llm.stream(ids, params) if delta.token_ids]
        return start, times

    stream_times(prompt(args.prompt_len), 4)  # warm-up
    ttfts, tpots = [], []
    for _ in range(args.repeats):
        start, times = stream_times(prompt(args.prompt_len), 1)
        ttfts.append(times[0] - start)
    for _ in range(max(1, args.repeats // 2)):
        _, times = stream_times(prompt(args.decode_prompt_len), args.output_len)
        tpots.extend(b - a for a, b in zip(times, times[1:]))
    result = {"model": args.model, "attention_backend": llm.engine.runner.backend.name,
              "cuda_graphs": getattr(llm.engine.runner, "graph_runner", None) is not None,
              "torch_compile": llm.engine.config.torch_compile, "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
              "quantization": llm.engine.config.quantization,
              "ttft_ms": 1e3 * statistics.median(ttfts), "ttft_prompt_len": args.prompt_len,
              "tpot_ms": 1e3 * statistics.median(tpots), "tpot_p90_ms": 1e3 * _quantile(tpots, 0.9),
              "tpot_output_len": args.output_len}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"kvmesh bench latency: {result['model']}, backend {result['attention_backend']}, "
              f"CUDA graphs {'on' if result['cuda_graphs'] else 'off'}")
        print(f"  TTFT ({args.prompt_len}-token prompt): {result['ttft_ms']:.2f} ms (median of {args.repeats})")
        print(f"  TPOT (batch 1): {result['tpot_ms']:.3f} ms median, {result['tpot_p90_ms']:.3f} ms p90")
    return 0


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
