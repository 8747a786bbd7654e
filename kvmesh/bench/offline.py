"""`kvmesh bench offline`: engine throughput on nano-vllm's workload, against the hardware floor
measured in the same run, and optionally against peers run in the same run. `--workload
shared-prefix` runs a prefill-heavy one instead (long shared system prompts, short outputs) and
reports the FLOP rate the prefill reached.

Default: the Qwen3-0.6B shape with random bf16 weights (`random:qwen3-0.6b`), 256 prompts. On the
CPU use a tiny preset and short lengths (the CI smoke test does).
"""

import gc
import json
import sys
import time

from kvmesh.bench.engine_probe import sync as _sync
from kvmesh.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES

DEFAULT_MODEL = "random:qwen3-0.6b"
# For --structured-outputs json: strings take almost any token, so a random model's outputs stay
# long (as unconstrained ones) while every step still computes a mask per row.
STRUCTURED_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
                     "required": ["items"]}


def add_arguments(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--num-prompts", type=int, default=256, help="prompts (default 256, nano-vllm's)")
    p.add_argument("--max-input-len", type=int, default=1024, help="prompt length drawn in [min-len, this]")
    p.add_argument("--max-output-len", type=int, default=None,
                   help="max_tokens drawn in [min-len, this] (default 1024); with --workload shared-prefix "
                        "in [16, this] (default 64)")
    p.add_argument("--min-len", type=int, default=100, help="lower bound of both draws (default 100)")
    p.add_argument("--workload", choices=["nano-vllm", "shared-prefix"], default="nano-vllm",
                   help="nano-vllm (default): its benchmark exactly; shared-prefix: prefill-heavy, each "
                        "prompt one of --num-prefixes system prompts of --prefix-len tokens plus a suffix "
                        "of [min-len, max-input-len] tokens")
    p.add_argument("--prefix-len", type=int, default=4096, help="shared-prefix: system prompt tokens (default 4096)")
    p.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: distinct system prompts (default 8)")
    p.add_argument("--attention-backend", default="auto",
                   choices=ATTENTION_BACKENDS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model dtype; fp8 / fp8_e4m3: an FP8 KV cache (half the bytes)")
    p.add_argument("--peer", action="append", default=[], choices=["nano-vllm", "transformers"],
                   help="also run this engine on the same workload in the same run (repeatable)")
    p.add_argument("--peer-num-prompts", type=int, default=None,
                   help="transformers peer: run only the first N prompts (it is slow)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size (default 16, rounded up to the backend's block_size_multiple)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may use; the KV pool gets what the weights "
                        "and activations leave (default 0.9)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default 4096, or what the longest request needs when that is more")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs the model is split over (the floor stays one GPU's)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: the linear layers' weights in FP8 (e4m3, per-tensor scales), as vLLM's")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="the engine's queue order (every prompt has priority 0, so the same schedule)")
    p.add_argument("--torch-compile", action="store_true",
                   help="torch.compile the layers' work outside attention (compiled before the timed run)")
    p.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                   help="launch step N+1 before step N's tokens reach the host (default: on for CUDA)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--profile-step", type=int, default=None,
                   help="profile this step of the run (torch.profiler) and print where its time goes")
    p.add_argument("--profile-trace", default=None,
                   help="write the profiled step's Chrome trace here; with --profile-window, the window's, "
                        "host activity included (the host loop then runs slower than without)")
    p.add_argument("--profile-window", default=None, metavar="FIRST:LAST",
                   help="profile the GPU's kernels from step FIRST to step LAST of the run (no host "
                        "tracing) and report how busy the GPU was over that wall time: whether the "
                        "device or the host loop bounds the run")
    p.add_argument("--step-times", action="store_true",
                   help="time each step on the device and fit the decode steps' time to a fixed cost "
                        "per step + a cost per sequence + a cost per KV token read (JSON key step_times)")
    p.add_argument("--structured-outputs", choices=["none", "json"], default="none",
                   help="json: every request's output must match STRUCTURED_SCHEMA (an object holding "
                        "an array of strings), to measure the grammar mask's cost; a request may then "
                        "end before its max_tokens, so output tokens are counted, not checked")
    p.add_argument("--text-each-step", action="store_true",
                   help="decode each sequence's text at every step with the engine's incremental "
                        "detokenizer, as a server's engine does for streaming (by asking to keep special "
                        "tokens; without it the outputs are decoded once at the end): the serving "
                        "path's detokenization cost, measured offline")
    p.add_argument("--logprobs-out", default=None, metavar="PATH",
                   help="after the timed run, score the first --logprobs-prompts prompts (each prompt "
                        "token's log-probability, greedy, no prefix cache) and write them to PATH as JSON; "
                        "`kvmesh bench logprob-diff A B` compares two such files (e.g. bf16 against FP8)")
    p.add_argument("--logprobs-prompts", type=int, default=32, help="prompts scored for --logprobs-out (default 32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def engine_args(args) -> dict:
    from kvmesh.worker.attention.registry import block_size_for  # imports torch: not at CLI parse time

    block_size = args.block_size or block_size_for(args.attention_backend)
    max_model_len = getattr(args, "max_model_len", None) or 4096
    return dict(device=args.device, attention_backend=args.attention_backend, block_size=block_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max_model_len, enforce_eager=args.enforce_eager,
                gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                torch_compile=getattr(args, "torch_compile", False),
                async_scheduling=getattr(args, "async_scheduling", None),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                quantization=getattr(args, "quantization", None),
                scheduling_policy=getattr(args, "scheduling_policy", "fcfs"))


def run(args) -> int:
    """Run nano-vllm's benchmark workload through the engine in this process; print output and total
    tok/s and the ratio to the hardware floor."""
    import torch

    from kvmesh import LLM, SamplingParams, StructuredOutputs
    from kvmesh.bench.engine_probe import StepProbe, fit_decode_steps
    from kvmesh.bench.floor import FloorCounter, ModelShape, measure_ceilings
    from kvmesh.bench.peers import run_peer

    window = _window(args.profile_window) if getattr(args, "profile_window", None) else None
    if window is not None and args.profile_step is not None:
        raise ValueError("--profile-window and --profile-step each run a profiler: give one")
    workload, is_reference = _workload(args)
    if args.max_model_len is None:  # room for the longest request, in steps of 1,024
        longest = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens))
        args.max_model_len = max(4096, -(-longest // 1024) * 1024)

    # Peers first, each in its own process, so each engine finds the GPU's memory free.
    peers = {name: run_peer(name, workload, args) for name in args.peer}

    llm = LLM(model=args.model, **engine_args(args))
    engine = llm.engine
    device = engine.device
    ceilings = measure_ceilings(device)
    vocab = engine.model_config.vocab_size
    workload.prompts = workload.prompts_for_vocab(vocab)
    # warm-up: the sampler's kernels, the allocator (not timed); the engine ran its large prompt
    # steps when it started (ModelRunner.warm_up_prompt_steps)
    warm = [[i % vocab for i in range(args.min_len)]] * 2
    llm.generate(prompt_token_ids=warm,
                 sampling_params=SamplingParams(max_tokens=4, temperature=0.6, ignore_eos=True), use_tqdm=False)
    probe = StepProbe(engine, args.profile_step, args.profile_trace, window,
                      step_times=getattr(args, "step_times", False))
    structured = (StructuredOutputs(json=STRUCTURED_SCHEMA)
                  if getattr(args, "structured_outputs", "none") == "json" else None)
    text_each_step = getattr(args, "text_each_step", False)
    params = [SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=m,
                             structured_outputs=structured, skip_special_tokens=not text_each_step)
              for m in workload.max_tokens]
    if structured is not None:  # compiled once, before the timed run (as a server's cache would)
        engine.grammar_compiler.compile(structured)
    _sync(device)
    allocations = allocator_counts(device)
    pauses = GcPauses()
    start = time.perf_counter()
    with pauses:
        outputs = llm.generate(prompt_token_ids=workload.prompts, sampling_params=params, use_tqdm=True)
        _sync(device)
    seconds = time.perf_counter() - start
    allocations = {name: count - allocations[name] for name, count in allocator_counts(device).items()}
    probe.finish()
    probe.detach()

    output_tokens = sum(len(o.token_ids) for o in outputs)
    if structured is None and output_tokens != workload.num_output_tokens:
        raise RuntimeError(f"engine produced {output_tokens} tokens, the workload asks {workload.num_output_tokens}")
    if args.logprobs_out:
        _write_prompt_logprobs(llm, workload.prompts[:args.logprobs_prompts], args)
    cfg = engine.model_config
    moe = dict(num_experts=cfg.moe.num_experts, experts_per_token=cfg.moe.num_experts_per_tok,
               expert_intermediate_size=cfg.moe.expert_intermediate_size,
               num_sparse_layers=len(cfg.moe.sparse_layers)) if cfg.moe is not None else {}
    shape = ModelShape(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                       cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings,
                       torch.tensor([], dtype=engine.dtype).element_size(),
                       kv_dtype_bytes=torch.tensor([], dtype=engine.kv_cache_dtype).element_size(), **moe)
    floor = FloorCounter(shape, ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"])
    for query_lens, seq_lens, num_sampled in probe.steps:
        floor.add_step(query_lens, seq_lens, num_sampled)
    cached_tokens = sum(o.num_cached_tokens for o in outputs)
    result = {
        "model": args.model, "workload": args.workload, "device": _device_name(device), "attention_backend": engine.runner.backend.name,
        "cuda_graphs": getattr(engine.runner, "graph_runner", None) is not None,
        "kv_cache_dtype": engine.config.kv_cache_dtype, "kv_blocks": engine.num_kv_blocks,
        "preemptions": engine.scheduler.num_preemptions,  # a pool too small for the workload shows here
        "async_scheduling": engine.async_scheduling, "torch_compile": engine.config.torch_compile,
        # the floor below is one GPU's, whatever the tensor-parallel size
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        # the floor stays the dtype model's (weights read at dtype bytes, bf16 matmul rate) with fp8 too
        "quantization": engine.config.quantization,
        "scheduling_policy": engine.config.scheduling_policy,
        "structured_outputs": "none" if structured is None else "json",
        "text_each_step": text_each_step,
        # with ignore_eos only a complete grammar ends a request before its max_tokens
        "grammar_completed": sum(o.finish_reason == "stop" for o in outputs),
        "num_prompts": args.num_prompts, "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": output_tokens, "seconds": seconds,
        "output_tok_per_s": output_tokens / seconds,
        "total_tok_per_s": (output_tokens + workload.num_prompt_tokens) / seconds,
        "cached_prompt_tokens": cached_tokens,
        # the FLOPs the run computed (cached prompt tokens excluded) over its time
        "achieved_flop_per_s": floor.flops / seconds,
        "steps": len(probe.steps), "floor_seconds": floor.seconds, "floor_ratio": floor.seconds / seconds,
        "floor_bytes": floor.bytes, "floor_flops": floor.flops, **ceilings,
        "host_seconds_outside_execute": probe.step_seconds - probe.execute_seconds,
        "execute_seconds": probe.execute_seconds, "nano_vllm_workload": is_reference,
        # CUDA: the allocators' calls into the driver during the timed run (docs/PERF.md, s27: no
        # device allocation, ~28 pinned blocks in under a millisecond)
        "allocations": allocations,
        # the host's pauses for Python's cyclic garbage collector during the timed run
        "gc": pauses.summary(),
        "peers": {}, "command": " ".join(["kvmesh"] + sys.argv[1:]) if sys.argv else "",
    }
    for name, peer in peers.items():
        peer = dict(peer)
        if peer.get("output_tok_per_s"):
            peer["kvmesh_speedup"] = result["output_tok_per_s"] / peer["output_tok_per_s"]
            if peer.get("num_prompts", args.num_prompts) == args.num_prompts:
                peer["floor_ratio"] = floor.seconds / peer["seconds"]
        result["peers"][name] = peer
    if probe.profile_table:
        result["profile"] = probe.profile_table
    if probe.window is not None:
        result["profile_window"] = probe.window
    if probe.step_times:
        result["step_times"] = fit_decode_steps(probe.steps, probe.step_device_ms())
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def _window(text: str) -> tuple[int, int]:
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        first = last = -1
    if not 0 <= first < last:
        raise ValueError(f"--profile-window must be FIRST:LAST with 0 <= FIRST < LAST, got {text!r}")
    return first, last


def _write_prompt_logprobs(llm, prompts: list[list[int]], args) -> None:
    """Each prompt token's log-probability (entry 0 has no context and is left out), written with
    what the engine ran, for `kvmesh bench logprob-diff`."""
    from kvmesh import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    config = llm.engine.config
    record = {"model": args.model, "attention_backend": llm.engine.runner.backend.name,
              "kv_cache_dtype": config.kv_cache_dtype, "quantization": config.quantization,
              "prompt_lengths": [len(p) for p in prompts],
              "prompt_logprobs": [o.prompt_logprobs.logprobs[1:] for o in outputs]}
    with open(args.logprobs_out, "w") as f:
        json.dump(record, f)


def _workload(args):
    """(Workload, whether it is nano-vllm's own) from the command's flags; a ValueError naming the flag."""
    from kvmesh.bench.workloads import (NANO_VLLM_OUTPUT_TOKENS, NANO_VLLM_PROMPT_TOKENS, nano_vllm_workload,
                                        shared_prefix_workload)

    if args.num_prompts < 1 or args.min_len < 1 or args.max_input_len < args.min_len:
        raise ValueError("need --num-prompts >= 1 and 1 <= --min-len <= --max-input-len")
    if args.logprobs_out and args.logprobs_prompts < 1:  # checked before the run, not after it
        raise ValueError(f"--logprobs-prompts must be >= 1, got {args.logprobs_prompts}")
    if args.workload == "shared-prefix":
        max_output = 64 if args.max_output_len is None else args.max_output_len
        if max_output < 1 or args.prefix_len < 1 or args.num_prefixes < 1:
            raise ValueError("need --max-output-len, --prefix-len and --num-prefixes >= 1")
        return shared_prefix_workload(args.num_prompts, args.prefix_len, args.num_prefixes, args.min_len,
                                      args.max_input_len, max_output), False
    max_output = 1024 if args.max_output_len is None else args.max_output_len
    if max_output < args.min_len:
        raise ValueError("need --min-len <= --max-output-len")
    workload = nano_vllm_workload(args.num_prompts, args.max_input_len, max_output, args.min_len)
    is_reference = (args.num_prompts, args.max_input_len, max_output, args.min_len) == (256, 1024, 1024, 100)
    if is_reference and (workload.num_output_tokens, workload.num_prompt_tokens) != (
            NANO_VLLM_OUTPUT_TOKENS, NANO_VLLM_PROMPT_TOKENS):
        raise RuntimeError(f"workload drifted: {workload.num_prompt_tokens} prompt and {workload.num_output_tokens} "
                           f"output tokens, nano-vllm's has {NANO_VLLM_PROMPT_TOKENS} and {NANO_VLLM_OUTPUT_TOKENS}")
    return workload, is_reference


def print_table(r: dict) -> None:
    print(f"kvmesh bench offline: {r['model']} on {r['device']}, backend {r['attention_backend']}, "
          f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}"
          + (", torch.compile on" if r.get("torch_compile") else "")
          + (", structured outputs: json schema on every request"
             if r.get("structured_outputs") == "json" else ""))
    print(f"  {r['num_prompts']} prompts, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens, "
          f"{r['steps']} steps" + (" (nano-vllm's workload)" if r["nano_vllm_workload"] else "")
          + (f", {r['workload']} workload" if r.get("workload", "nano-vllm") != "nano-vllm" else ""))
    print(f"  prompt tokens from the prefix cache {r['cached_prompt_tokens']}; computed at "
          f"{r['achieved_flop_per_s'] / 1e12:.1f} TFLOP/s")
    print(f"  ceilings: copy {r['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {r['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
    rows = [("kvmesh", r["seconds"], r["output_tok_per_s"], r["total_tok_per_s"], r["floor_ratio"], None)]
    for name, p in r["peers"].items():
        if "error" in p:
            print(f"  peer {name}: failed: {p['error']}")
            continue
        rows.append((name + ("" if p.get("num_prompts", r["num_prompts"]) == r["num_prompts"]
                             else f" ({p['num_prompts']} prompts)"),
                     p["seconds"], p["output_tok_per_s"], p.get("total_tok_per_s", float("nan")),
                     p.get("floor_ratio", float("nan")), p.get("kvmesh_speedup")))
    print(f"  {'engine':28s} {'seconds':>8s} {'out tok/s':>10s} {'total tok/s':>12s} {'floor':>6s} {'kvmesh x':>8s}")
    for name, s, out, total, ratio, speedup in rows:
        sp = f"{speedup:8.2f}" if speedup else f"{'':8s}"
        print(f"  {name:28s} {s:8.2f} {out:10.0f} {total:12.0f} {ratio:6.3f} {sp}")
    print(f"  floor {r['floor_seconds']:.2f} s; host time outside execute {r['host_seconds_outside_execute']:.2f} s, "
          f"execute {r['execute_seconds']:.2f} s")
    if r.get("profile"):
        print(r["profile"])
    if r.get("step_times"):
        _print_step_times(r["step_times"])
    if r.get("profile_window"):
        w = r["profile_window"]
        print(f"  GPU over {w['steps']} steps: busy {w['gpu_busy_ms']:.1f} of {w['wall_ms']:.1f} ms wall "
              f"({w['gpu_busy_fraction']:.1%}), {w['kernels']} kernels and copies; most time:")
        calls = w.get("kernel_calls_by_name", {})
        for name, ms in w["kernel_ms_by_name"].items():
            print(f"    {ms:9.2f} ms  {calls.get(name, 0):8d} calls  {name}")
        if "short_gap_ms" in w:
            print(f"  idle between kernels: {w['short_gap_ms']:.1f} ms in {w['short_gaps']} gaps under "
                  f"20 us, {w['long_gap_ms']:.1f} ms in longer ones; the short gaps by the kernel after them:")
            for name, ms in w["short_gap_ms_before"].items():
                print(f"    {ms:9.2f} ms  {name}")
        if w.get("long_gaps"):
            print(f"  the {w['long_gaps']} longer gaps (the device waiting for the host) by tenth of the "
                  "window: " + " ".join(f"{ms:.1f}" for ms in w["long_gap_ms_by_tenth"]) + " ms; by the kernel after them:")
            for name, ms in w["long_gap_ms_before"].items():
                print(f"    {ms:9.2f} ms  {name}")
            print("  and by the kernel before them:")
            for name, ms in w["long_gap_ms_after"].items():
                print(f"    {ms:9.2f} ms  {name}")


def _print_step_times(t: dict) -> None:
    print(f"  device time: {t['decode_steps']} decode steps {t['decode_ms']:.0f} ms, "
          f"{t['other_steps']} others {t['other_ms']:.0f} ms")
    if "fixed_ms" in t:
        print(f"  a decode step = {t['fixed_ms']:.3f} ms + {t['per_seq_us']:.2f} us per sequence + "
              f"{t['per_kv_token_ns']:.3f} ns per KV token (r2 {t['r2']:.3f}); the fixed part is "
              f"{t['fixed_share_of_decode']:.0%} of the decode steps' time")


class GcPauses:
    """Within the block: each collection of Python's cyclic garbage collector, its generation and
    how long the host was inside it (gc.callbacks)."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """Per generation: collections, their total and longest pause (ms)."""
        out = {}
        for gen in sorted({g for g, _ in self.pauses}):
            ms = [s * 1e3 for g, s in self.pauses if g == gen]
            out[f"gen{gen}"] = {"collections": len(ms), "total_ms": round(sum(ms), 2), "max_ms": round(max(ms), 2)}
        return out


def allocator_counts(device) -> dict[str, int]:
    """PyTorch's device and pinned-host allocators: how often each has called the driver (cudaMalloc,
    cudaFree, cudaHostAlloc), retried after freeing its cache, and spent in cudaHostAlloc (us);
    {} off CUDA."""
    import torch

    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    counts = {name: int(stats.get(name, 0)) for name in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    host = torch.cuda.host_memory_stats()
    counts.update({f"host_{name}": int(host.get(name, 0)) for name in ("num_host_alloc", "num_host_free")})
    counts["host_alloc_us"] = int(host.get("host_alloc_time.total", 0))  # time inside those calls
    return counts


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
