"""`kvmesh bench offline` / `latency` on the CPU with a tiny preset (seconds): the CLI runs, the JSON
has the numbers the GPU run reports, and the workload is nano-vllm's."""

import gc
import json

import pytest

from kvmesh.bench.floor import FloorCounter, ModelShape
from kvmesh.bench.workloads import NANO_VLLM_OUTPUT_TOKENS, NANO_VLLM_PROMPT_TOKENS, nano_vllm_workload
from kvmesh.cli import main

TINY = ["--model", "random:tiny-qwen3", "--device", "cpu"]


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_workload_is_nano_vllms():
    workload = nano_vllm_workload()
    assert len(workload.prompts) == 256
    assert workload.num_output_tokens == NANO_VLLM_OUTPUT_TOKENS == 133_966
    assert workload.num_prompt_tokens == NANO_VLLM_PROMPT_TOKENS == 142_827  # PERF.md's figures
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in workload.prompts)


def test_offline_smoke(capsys):
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "3", "--max-input-len", "24",
                          "--max-output-len", "12", "--min-len", "4", "--json"])
    expected = nano_vllm_workload(3, 24, 12, 4)
    assert r["output_tokens"] == expected.num_output_tokens
    assert r["prompt_tokens"] == expected.num_prompt_tokens
    assert r["attention_backend"] == "torch" and r["cuda_graphs"] is False
    assert r["output_tok_per_s"] > 0 and r["total_tok_per_s"] > r["output_tok_per_s"]
    assert 0 < r["floor_ratio"] < 1 and r["floor_seconds"] > 0
    assert r["steps"] >= max(expected.max_tokens)  # one step per output token of the longest request
    assert r["structured_outputs"] == "none" and r["grammar_completed"] == 0
    assert r["preemptions"] == 0
    assert 0 < r["execute_seconds"] and 0 <= r["host_seconds_outside_execute"]
    assert r["execute_seconds"] + r["host_seconds_outside_execute"] <= r["seconds"]
    assert r["allocations"] == {}  # the CUDA allocators' counts: none on the CPU
    for gen, pauses in r["gc"].items():  # the garbage collector's pauses in the timed run, if any
        assert gen in ("gen0", "gen1", "gen2") and pauses["collections"] > 0
        assert 0 <= pauses["max_ms"] <= pauses["total_ms"] <= r["seconds"] * 1e3


def test_text_each_step_runs_the_incremental_detokenizer_on_every_token(capsys, monkeypatch):
    """--text-each-step: the engine's incremental detokenizer takes every output token at its step,
    as a server's engine does; without it, none (the outputs are decoded once at the end)."""
    from kvmesh.worker.detokenizer import IncrementalDetokenizer

    fed = []
    add_tokens = IncrementalDetokenizer.add_tokens

    def counting(self, new_token_ids, check_stop=True):
        fed.extend(new_token_ids)
        return add_tokens(self, new_token_ids, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", counting)
    args = ["bench", "offline", *TINY, "--num-prompts", "3", "--max-input-len", "24", "--max-output-len", "12",
            "--min-len", "4", "--json"]
    r = run_json(capsys, args)
    assert r["text_each_step"] is False and fed == []
    r = run_json(capsys, args + ["--text-each-step"])
    # the warm-up's 2 x 4 tokens decode once at the end either way; the timed run's, one by one
    assert r["text_each_step"] is True and len(fed) == r["output_tokens"]


def test_gc_pauses_count_each_collection_by_generation():
    from kvmesh.bench.offline import GcPauses

    with GcPauses() as pauses:
        for gen in (0, 2, 2):
            gc.collect(gen)
    summary = pauses.summary()
    assert summary["gen0"]["collections"] == 1 and summary["gen2"]["collections"] == 2
    assert summary["gen2"]["max_ms"] <= summary["gen2"]["total_ms"]
    assert pauses._callback not in gc.callbacks  # removed on leaving the block


def test_offline_passes_gpu_memory_utilization_and_counts_preemptions(capsys, monkeypatch):
    """--gpu-memory-utilization reaches the engine (out of range: an error naming it, exit 2); a pool
    too small for the workload shows as preemptions in the JSON."""
    import argparse

    from kvmesh.bench.offline import add_arguments, engine_args
    from kvmesh.worker import kv_sizing

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_args(parser.parse_args(["--gpu-memory-utilization", "0.35"]))["gpu_memory_utilization"] == 0.35
    assert engine_args(parser.parse_args([]))["gpu_memory_utilization"] == 0.9
    assert main(["bench", "offline", *TINY, "--gpu-memory-utilization", "1.5"]) == 2
    assert "gpu_memory_utilization" in capsys.readouterr().err
    # 64 KiB of KV on the CPU: 8-16 blocks of 16 tokens, against 6 requests of up to 4 blocks each
    monkeypatch.setattr(kv_sizing, "CPU_DEFAULT_KV_BYTES", 64 * 1024)
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "6", "--max-input-len", "40",
                          "--max-output-len", "24", "--min-len", "20", "--block-size", "16", "--json"])
    assert r["kv_blocks"] <= 16 and r["preemptions"] > 0
    assert r["output_tokens"] == nano_vllm_workload(6, 40, 24, 20).num_output_tokens  # nothing lost


def test_offline_with_structured_outputs_masks_every_request(capsys):
    """The lead's GPU comparison runs this with and without --structured-outputs json."""
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "6", "--max-input-len", "24",
                          "--max-output-len", "40", "--min-len", "4", "--structured-outputs", "json",
                          "--json"])
    expected = nano_vllm_workload(6, 24, 40, 4)
    assert r["structured_outputs"] == "json" and r["output_tok_per_s"] > 0
    # the tiny byte vocabulary makes closing the JSON likely: some requests end by their grammar
    assert r["grammar_completed"] > 0
    assert 0 < r["output_tokens"] < expected.num_output_tokens


def test_offline_runs_the_transformers_peer_on_the_same_workload(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_PEER_MODEL_DIR", str(tmp_path / "peer"))
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "3", "--max-input-len", "24",
                          "--max-output-len", "12", "--min-len", "4", "--peer", "transformers", "--json"])
    peer = r["peers"]["transformers"]
    assert "error" not in peer, peer.get("error")
    expected = nano_vllm_workload(3, 24, 12, 4)
    each = peer["max_tokens_each"]  # generate_batch takes one max_new_tokens: the workload's mean
    assert each == round(expected.num_output_tokens / 3) and peer["output_tokens"] == 3 * each
    assert peer["num_prompts"] == 3 and peer["output_tok_per_s"] > 0 and peer["kvmesh_speedup"] > 0
    assert peer["floor_ratio"] == pytest.approx(r["floor_seconds"] / peer["seconds"])  # same workload


def test_peer_num_prompts_runs_the_transformers_peer_on_the_workloads_first_prompts(capsys, tmp_path, monkeypatch):
    """PERF.md's `--peer transformers --peer-num-prompts 64`: the peer runs the first N prompts,
    kvmesh all of them, and the speedup compares their throughputs."""
    monkeypatch.setenv("KVMESH_PEER_MODEL_DIR", str(tmp_path / "peer"))
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "4", "--max-input-len", "24",
                          "--max-output-len", "12", "--min-len", "4", "--peer", "transformers",
                          "--peer-num-prompts", "2", "--json"])
    peer = r["peers"]["transformers"]
    assert "error" not in peer, peer.get("error")
    expected = nano_vllm_workload(4, 24, 12, 4)
    assert peer["num_prompts"] == 2 and r["num_prompts"] == 4
    assert peer["max_tokens_each"] == round(sum(expected.max_tokens[:2]) / 2)
    assert peer["kvmesh_speedup"] == pytest.approx(r["output_tok_per_s"] / peer["output_tok_per_s"])
    assert "floor_ratio" not in peer  # the floor is the whole workload's: no ratio for a subset


def test_profile_step_prints_where_one_steps_time_went(capsys):
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "2", "--max-input-len", "16",
                          "--max-output-len", "6", "--min-len", "4", "--profile-step", "2", "--json"])
    head, table = r["profile"].split("\n", 1)
    assert head.startswith("one step: 2 sequences (2 decodes), 2 tokens, context ")  # step 2: both decode
    assert "aten::" in table and "Self CPU" in table, table[:500]  # the ops, by their own time


def test_latency_smoke(capsys):
    r = run_json(capsys, ["bench", "latency", *TINY, "--prompt-len", "32", "--decode-prompt-len", "8",
                          "--output-len", "6", "--repeats", "2", "--json"])
    assert r["ttft_prompt_len"] == 32 and r["ttft_ms"] > 0 and r["tpot_ms"] > 0


def test_latency_takes_fp8_weights(capsys):
    r = run_json(capsys, ["bench", "latency", *TINY, "--prompt-len", "16", "--decode-prompt-len", "8",
                          "--output-len", "4", "--repeats", "1", "--quantization", "fp8", "--json"])
    assert r["quantization"] == "fp8" and r["ttft_ms"] > 0 and r["tpot_ms"] > 0


def test_floor_counts_weights_once_and_kv_per_sequence():
    shape = ModelShape(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                       head_dim=4, vocab_size=10, tie_word_embeddings=True)
    floor = FloorCounter(shape, copy_bytes_per_s=1e9, matmul_flops_per_s=1e18)  # bandwidth-bound
    floor.add_step(query_lens=[1, 1], seq_lens=[5, 9], num_sampled=2)  # two decodes
    kv_per_token = 2 * 2 * 1 * 4 * 2
    assert floor.bytes == shape.weight_bytes + (4 + 8 + 2) * kv_per_token
    assert floor.seconds == pytest.approx(floor.bytes / 1e9)


def test_floor_counts_flops_of_the_weights_the_logits_and_causal_attention():
    shape = ModelShape(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                       head_dim=4, vocab_size=10, tie_word_embeddings=True)
    floor = FloorCounter(shape, copy_bytes_per_s=1e18, matmul_flops_per_s=1e9)  # compute-bound
    floor.add_step(query_lens=[3], seq_lens=[5], num_sampled=1)  # a chunk of 3 after 2 cached tokens
    # 2 x params per token + the logits of the sampled row + QK^T and PV over 3 + 4 + 5 keys
    expected = 2 * shape.matmul_params * 3 + 2 * 10 * 8 * 1 + 4 * 2 * 2 * 4 * (3 + 4 + 5)
    assert floor.flops == expected
    assert floor.seconds == pytest.approx(expected / 1e9)  # the larger of the two times


def test_bench_serve_options_parse_through_the_cli():
    from kvmesh.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--rate", "8", "--policies", "kv_events,round_robin"])
    assert args.rate == [8] and args.policies == "kv_events,round_robin"
    assert args.handler.__module__ == "kvmesh.bench.serve"


def test_offline_shared_prefix_workload_hits_the_prefix_cache(capsys):
    """The prefill-heavy workload: long shared system prompts are computed once per prompt and then
    read from the prefix cache; the run reports the FLOP rate it reached."""
    from kvmesh.bench.workloads import shared_prefix_workload

    r = run_json(capsys, ["bench", "offline", *TINY, "--workload", "shared-prefix", "--num-prompts", "6",
                          "--prefix-len", "64", "--num-prefixes", "2", "--min-len", "4",
                          "--max-input-len", "12", "--max-output-len", "4", "--max-num-seqs", "2", "--json"])
    expected = shared_prefix_workload(6, 64, 2, 4, 12, 4)
    assert r["workload"] == "shared-prefix" and r["nano_vllm_workload"] is False
    assert r["prompt_tokens"] == expected.num_prompt_tokens and r["output_tokens"] == expected.num_output_tokens
    assert all(p[:64] == expected.prompts[i % 2][:64] for i, p in enumerate(expected.prompts))
    # two requests at a time: each prompt after the first two finds its 64-token prefix (4 blocks) cached
    assert r["cached_prompt_tokens"] >= 4 * 64
    assert r["achieved_flop_per_s"] > 0


def test_offline_flags_are_checked(capsys):
    assert main(["bench", "offline", *TINY, "--workload", "shared-prefix", "--prefix-len", "0", "--json"]) != 0
    assert "--prefix-len" in capsys.readouterr().err


def test_floor_of_a_moe_model_reads_only_the_experts_its_tokens_can_reach():
    shape = ModelShape(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                       head_dim=4, vocab_size=10, tie_word_embeddings=False, num_experts=4,
                       experts_per_token=2, expert_intermediate_size=6, num_sparse_layers=1)
    attention = 8 * 4 * (2 * 2 + 2 * 1)
    dense_layer = attention + 3 * 8 * 16
    sparse_fixed = attention + 8 * 4  # attention and the router
    expert = 3 * 8 * 6
    assert shape.matmul_params == dense_layer + sparse_fixed + 2 * expert
    # one token reaches its 2 experts; many reach all 4 (expected distinct: E * (1 - (1 - k/E)^n))
    assert shape.weight_bytes_for(1) == (dense_layer + 10 * 8 + sparse_fixed + 2 * expert) * 2
    assert shape.weight_bytes_for(2) == (dense_layer + 10 * 8 + sparse_fixed + 3 * expert) * 2
    assert shape.weight_bytes == (dense_layer + 10 * 8 + sparse_fixed + 4 * expert) * 2


def test_logprobs_out_and_logprob_diff_measure_fp8_weights_against_bf16(capsys, tmp_path):
    """The figure issue 17 asks for (FP8 against bf16 on nano-vllm's prompts) comes from two offline
    runs with --logprobs-out and `bench logprob-diff`: the same run twice differs by nothing, FP8
    weights by a small non-zero amount."""
    small = ["--num-prompts", "3", "--max-input-len", "24", "--max-output-len", "6", "--min-len", "4",
             "--logprobs-prompts", "2", "--json"]
    files = {}
    for name, extra in (("bf16", []), ("bf16_again", []), ("fp8", ["--quantization", "fp8"])):
        files[name] = tmp_path / f"{name}.json"
        run_json(capsys, ["bench", "offline", *TINY, *small, *extra, "--logprobs-out", str(files[name])])
    record = json.loads(files["fp8"].read_text())
    expected = nano_vllm_workload(3, 24, 6, 4)
    assert record["quantization"] == "fp8" and record["prompt_lengths"] == [len(p) for p in expected.prompts[:2]]
    assert [len(lp) for lp in record["prompt_logprobs"]] == [n - 1 for n in record["prompt_lengths"]]
    same = run_json(capsys, ["bench", "logprob-diff", str(files["bf16"]), str(files["bf16_again"]), "--json"])
    assert same["max_abs_diff"] == 0.0 and same["tokens"] == sum(n - 1 for n in record["prompt_lengths"])
    fp8 = run_json(capsys, ["bench", "logprob-diff", str(files["bf16"]), str(files["fp8"]), "--json"])
    assert 0 < fp8["mean_abs_diff"] <= fp8["p99_abs_diff"] <= fp8["max_abs_diff"] < 0.1
    assert fp8["runs"]["quantization"] == [None, "fp8"]
    assert main(["bench", "logprob-diff", str(files["bf16"]), str(files["fp8"])]) == 0
    assert "max" in capsys.readouterr().out


def test_logprob_diff_refuses_files_of_different_runs_and_a_bad_count_fails_before_the_run(capsys):
    from kvmesh.bench.logprob_diff import compare

    one = {"model": "m", "prompt_lengths": [3], "prompt_logprobs": [[-1.0, -2.0]],
           "attention_backend": "torch", "kv_cache_dtype": "auto", "quantization": None}
    with pytest.raises(ValueError, match="different runs"):
        compare(one, {**one, "prompt_lengths": [4]})
    with pytest.raises(ValueError, match="different runs"):
        compare(one, {**one, "model": "other"})
    # --logprobs-prompts 0 is refused by the workload check, before any engine is built or run
    assert main(["bench", "offline", *TINY, "--num-prompts", "3", "--logprobs-out", "/nonexistent/x.json",
                 "--logprobs-prompts", "0", "--json"]) == 2
    assert "--logprobs-prompts must be >= 1, got 0" in capsys.readouterr().err


def test_profile_window_with_a_trace_path_writes_the_hosts_activity_there(capsys, tmp_path):
    """--profile-window with --profile-trace: the window's Chrome trace, the host's calls in it
    (the engine's step and the runner's execute among them)."""
    trace = tmp_path / "window.json"
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "3", "--max-input-len", "24",
                          "--max-output-len", "12", "--min-len", "4", "--profile-window", "2:6",
                          "--profile-trace", str(trace), "--json"])
    assert r["profile_window"]["steps"] == 4
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events if e.get("ph") == "X"}
    assert any(name.startswith("aten::") for name in names), sorted(names)[:20]


def test_profile_window_reports_the_steps_it_covered_and_refuses_a_bad_range(capsys):
    """--profile-window FIRST:LAST profiles the device's kernels over those steps and reports their
    wall time and how busy the GPU was (here, without a GPU, no device time); a reversed range or
    one given with --profile-step exits 2 before any engine is built."""
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "3", "--max-input-len", "24",
                          "--max-output-len", "12", "--min-len", "4", "--profile-window", "2:6", "--json"])
    window = r["profile_window"]
    assert window["steps"] == 4 and window["wall_ms"] > 0
    assert window["gpu_busy_ms"] == 0.0 and window["gpu_busy_fraction"] == 0.0  # no device here
    assert window["kernel_ms_by_name"] == window["kernel_calls_by_name"] == {}
    assert main(["bench", "offline", *TINY, "--profile-window", "6:2"]) == 2
    assert "FIRST:LAST with 0 <= FIRST < LAST, got '6:2'" in capsys.readouterr().err
    assert main(["bench", "offline", *TINY, "--profile-window", "1:3", "--profile-step", "2"]) == 2
    assert "give one" in capsys.readouterr().err


def test_union_length_counts_overlapping_spans_once():
    from kvmesh.bench.engine_probe import union_length

    assert union_length([]) == 0.0
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0
    assert union_length([(4.0, 5.0), (0.0, 1.0)]) == 2.0


def test_idle_gaps_splits_launch_gaps_from_host_waits_and_names_the_late_kernel():
    from kvmesh.bench.engine_probe import idle_gaps

    spans = [(0.0, 10.0), (12.0, 20.0), (18.0, 30.0), (31.5, 40.0), (140.0, 150.0)]
    names = ["gemm", "norm", "attn", "norm", "gemm"]
    gaps = idle_gaps(spans, names)
    # 2 us before the first norm, 1.5 before the second (the overlap of norm and attn is no gap);
    # 100 us before the last gemm is the host's
    assert gaps["short_gaps"] == 2 and abs(gaps["short_gap_ms"] - 3.5e-3) < 1e-12
    assert abs(gaps["long_gap_ms"] - 0.1) < 1e-12
    assert gaps["short_gap_ms_before"] == {"norm": 3.5e-3}
    # the long gap is named by the kernel it ends (the host launched the gemm late) and the one
    # before it, and starts in the third tenth of the 150 us span (at 40 us)
    assert gaps["long_gaps"] == 1
    assert gaps["long_gap_ms_before"] == {"gemm": 0.1} and gaps["long_gap_ms_after"] == {"norm": 0.1}
    assert gaps["long_gap_ms_by_tenth"] == [0.0, 0.0, 0.1] + [0.0] * 7
    assert idle_gaps([], []) == {"short_gap_ms": 0.0, "short_gaps": 0, "long_gap_ms": 0.0,
                                 "short_gap_ms_before": {}, "long_gaps": 0, "long_gap_ms_before": {},
                                 "long_gap_ms_after": {}, "long_gap_ms_by_tenth": [0.0] * 10}


def test_fit_decode_steps_recovers_the_costs_and_leaves_prefill_steps_out():
    from kvmesh.bench.engine_probe import fit_decode_steps

    steps, ms = [([300, 200], [300, 200], 2)], [9.0]  # a prefill step: not in the fit
    for batch in (4, 16, 64, 128, 200, 256):
        for ctx in (100, 700, 1500):
            steps.append(([1] * batch, [ctx] * batch, batch))
            ms.append(1.25 + 0.002 * batch + 30e-6 * batch * ctx)  # ms: 1.25 fixed, 2 us/seq, 30 ns/token
    ms[5] += 40.0  # a step the host held up
    t = fit_decode_steps(steps, ms)
    assert t["decode_steps"] == 18 and t["other_steps"] == 1 and t["other_ms"] == 9.0
    assert t["fitted_steps"] == 17 and t["steps"][0] == [2, 500, 9.0] and len(t["steps"]) == 19
    assert abs(t["fixed_ms"] - 1.25) < 1e-9 and abs(t["per_seq_us"] - 2.0) < 1e-6
    assert abs(t["per_kv_token_ns"] - 30.0) < 1e-6 and t["r2"] > 0.999999
    assert abs(t["fixed_share_of_decode"] - 18 * t["fixed_ms"] / t["decode_ms"]) < 1e-12
    assert "fixed_ms" not in fit_decode_steps(steps[:3], ms[:3])  # too few decode steps to fit


def test_offline_step_times_time_every_step(capsys):
    r = run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "4", "--max-input-len", "24",
                          "--max-output-len", "16", "--min-len", "8", "--step-times", "--json"])
    t = r["step_times"]
    assert t["decode_steps"] + t["other_steps"] == r["steps"] and t["decode_steps"] >= 8
    assert t["decode_ms"] > 0 and t["other_ms"] > 0 and "fixed_ms" in t
    assert "step_times" not in run_json(capsys, ["bench", "offline", *TINY, "--num-prompts", "2",
                                                 "--max-input-len", "8", "--max-output-len", "4",
                                                 "--min-len", "4", "--json"])
