"""Tensor parallelism on the CPU (gloo, one process per rank): the engine split over 2 ranks gives
the same greedy tokens as one rank and log-probabilities within float32 rounding, with prefix caching
and chunked prefill on; KV heads fewer than the ranks are replicated; a vocabulary the ranks do not
divide is padded; a size the model cannot take is refused before any process starts."""

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmesh import LLM, SamplingParams
from kvmesh.config import EngineConfig
from kvmesh.serve_config import parse_config
from kvmesh.worker.layers.parallel import QKVParallelLinear, VocabParallelEmbedding
from kvmesh.worker.model_builder import model_config_for
from kvmesh.worker.presets import build_byte_tokenizer, hf_config_for
from kvmesh.worker.tensor_parallel import (TensorParallel, building_with, check_tensor_parallel,
                                           kv_head_start, local_heads, padded_vocab)
from tests.unit.reference import hf_greedy

REPO = Path(__file__).resolve().parents[2]
LOGPROB_TOLERANCE = 1e-5  # float32: the all-reduce sums the same terms in another order
# Small steps and blocks: prompts are chunked (16 tokens a step) and the repeated prompts hit the
# prefix cache in whole 4-token blocks.
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16)
PROMPTS = [list(range(1, 40, 3)), list(range(1, 40, 3)) + [9, 8, 7], [300, 12, 99]]


def generate(model: str, tensor_parallel_size: int):
    """Greedy outputs with logprobs and prompt logprobs, then the first two prompts again (now
    cached); the LLM is closed after."""
    with LLM(model, tensor_parallel_size=tensor_parallel_size, **ENGINE) as llm:
        scored = SamplingParams(max_tokens=10, temperature=0, logprobs=2, prompt_logprobs=1)
        first = llm.generate(prompt_token_ids=PROMPTS, sampling_params=scored, use_tqdm=False)
        again = llm.generate(prompt_token_ids=PROMPTS[:2], use_tqdm=False,
                             sampling_params=SamplingParams(max_tokens=10, temperature=0))
    return first, again


def assert_same(single, split):
    (first1, again1), (first2, again2) = single, split
    for one, two in zip(first1 + again1, first2 + again2):
        assert two.token_ids == one.token_ids
    for one, two in zip(first1, first2):
        assert two.logprobs == pytest.approx(one.logprobs, abs=LOGPROB_TOLERANCE)
        assert two.prompt_logprobs.logprobs[1:] == pytest.approx(one.prompt_logprobs.logprobs[1:],
                                                                 abs=LOGPROB_TOLERANCE)
    for one, two in zip(again1, again2):
        assert one.num_cached_tokens == two.num_cached_tokens == 12  # 3 blocks of the 13-token prompt


def test_two_ranks_match_one_rank_with_prefix_cache_and_chunked_prefill():
    model = "random:tiny-qwen3"  # 4 heads, 2 KV heads: one KV head per rank
    assert_same(generate(model, 1), generate(model, 2))


def test_fewer_kv_heads_than_ranks_are_replicated():
    model = "random:tiny-llama"  # 1 KV head over 2 ranks: each rank holds a copy
    assert_same(generate(model, 1), generate(model, 2))


def test_mixture_of_experts_layers_run_replicated_beside_split_attention():
    model = "random:tiny-qwen3-moe"  # experts whole on each rank (not split yet); attention split
    assert_same(generate(model, 1), generate(model, 2))


def test_sharded_checkpoint_load_with_padded_vocabulary_matches_transformers(tmp_path):
    """A Hugging Face directory (q/k/v biases, untied LM head) with a vocabulary of 509 ids over 2
    ranks: each rank reads its slices of the full tensors; the padding ids are never sampled."""
    config = hf_config_for("tiny-qwen2")
    config.vocab_size = 509
    torch.manual_seed(5)
    reference = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.05)
    reference.save_pretrained(tmp_path)
    build_byte_tokenizer(509).save_pretrained(tmp_path)
    prompt = [5, 200, 17, 480, 33, 1]
    with LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE) as llm:
        out = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.token_ids == hf_greedy(reference.eval(), prompt, 12)


# ---- sizes the model cannot take --------------------------------------------------------------

def test_heads_not_divisible_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the model's 4 attention heads"):
        LLM("random:tiny-qwen3", tensor_parallel_size=3, device="cpu")


def test_kv_heads_neither_divisible_nor_a_divisor_are_refused():
    config = dataclasses.replace(model_config_for("random:tiny-qwen3"), num_heads=6, num_kv_heads=3,
                                 intermediate_size=120)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the model's 3 KV heads"):
        check_tensor_parallel(config, 2, torch.device("cpu"), torch_compile=False)


def test_an_intermediate_size_the_ranks_cannot_split_is_refused():
    config = dataclasses.replace(model_config_for("random:tiny-qwen3"), num_heads=4, num_kv_heads=2,
                                 intermediate_size=121)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the model's intermediate_size 121"):
        check_tensor_parallel(config, 2, torch.device("cpu"), torch_compile=False)


def test_more_ranks_than_gpus_is_refused():
    available = torch.cuda.device_count()
    size = 2 * max(2, available)  # 4 heads on the CPU machine: a size the heads allow
    config = dataclasses.replace(model_config_for("random:tiny-qwen3"), num_heads=size, num_kv_heads=size)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size {size} needs GPUs 0..{size - 1}; "
                                         rf"this process sees {available}"):
        check_tensor_parallel(config, size, torch.device("cuda"), torch_compile=False)


def test_torch_compile_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="torch_compile is not supported with tensor_parallel_size > 1"):
        check_tensor_parallel(model_config_for("random:tiny-qwen3"), 2, torch.device("cpu"), torch_compile=True)


def test_engine_argument_and_serving_field():
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an integer >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    cfg = parse_config({"engine": {"tensor_parallel_size": 2}, "replicas": {"num_gpus": 2}})
    assert cfg.engine_config("w").tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"replicas.num_gpus .*engine.tensor_parallel_size"):
        parse_config({"engine": {"tensor_parallel_size": 2}, "replicas": {"num_gpus": 1}})
    assert parse_config({"engine": {"tensor_parallel_size": 2}, "replicas": {"num_gpus": 0}})  # CPU ranks


def test_a_rank_that_fails_to_start_ends_the_others_and_leaves_the_group():
    import torch.distributed as dist

    with pytest.raises(ValueError, match="hold no KV block"):
        LLM("random:tiny-qwen3", tensor_parallel_size=2, device="cpu", kv_cache_memory_bytes=1)
    assert not dist.is_initialized()  # so the next engine with tensor_parallel_size > 1 can start


# ---- how the model splits (no processes) ------------------------------------------------------

def test_heads_and_vocabulary_split():
    assert local_heads(32, 8, 2) == (16, 4)
    assert local_heads(4, 1, 2) == (2, 1)
    assert [kv_head_start(8, r, 2) for r in range(2)] == [0, 4]
    assert [kv_head_start(2, r, 4) for r in range(4)] == [0, 0, 1, 1]  # replicated in pairs
    assert padded_vocab(509, 2) == 510 and padded_vocab(512, 4) == 512


def test_each_rank_loads_its_slice_of_the_full_tensors():
    hidden, head_dim, heads, kv_heads = 8, 2, 4, 2
    q = torch.arange(heads * head_dim * hidden, dtype=torch.float32).view(-1, hidden)
    k = -torch.arange(kv_heads * head_dim * hidden, dtype=torch.float32).view(-1, hidden)
    v = k - 1000
    embedding = torch.arange(5 * hidden, dtype=torch.float32).view(5, hidden)
    for rank in range(2):
        with building_with(TensorParallel(rank, 2)):
            qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False)
            embed = VocabParallelEmbedding(5, hidden)
        for shard, full in enumerate((q, k, v)):
            qkv.weight.weight_loader(qkv.weight, full, shard, "qkv")
        embed.weight.weight_loader(embed.weight, embedding, None, "embed")
        q_rows, kv_rows = heads * head_dim // 2, kv_heads * head_dim // 2
        expected = torch.cat([q[rank * q_rows:(rank + 1) * q_rows], k[rank * kv_rows:(rank + 1) * kv_rows],
                              v[rank * kv_rows:(rank + 1) * kv_rows]])
        assert torch.equal(qkv.weight.data, expected)
        rows = [embedding[0:3], torch.cat([embedding[3:5], torch.zeros(1, hidden)])][rank]  # id 5 pads
        assert torch.equal(embed.weight.data, rows)


# ---- in a worker replica's engine process -----------------------------------------------------

def test_an_engine_process_runs_two_ranks_and_stops_them():
    """The serving transport (cluster/engine_process.py): its engine child starts the follower rank,
    serves a request with TP=1's tokens, and on Stop both processes exit."""
    import queue

    import psutil

    from kvmesh.cluster.engine_core import StepReport, Submit
    from kvmesh.cluster.engine_process import EngineProcess
    from kvmesh.protocol import EngineRequest

    prompt, params = PROMPTS[1], SamplingParams(max_tokens=8, temperature=0)
    with LLM("random:tiny-qwen3", **ENGINE) as llm:
        expected = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].token_ids
    config = EngineConfig(model="random:tiny-qwen3", worker_id="w0", tensor_parallel_size=2,
                          **ENGINE)
    transport = EngineProcess(config, num_threads=1)
    engine_child = psutil.Process(transport.pid)
    ranks = [p for p in engine_child.children()  # (spawn also starts its resource tracker)
             if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 1  # rank 1 (rank 0 is the engine process itself)
    outputs = queue.Queue()
    transport.start(outputs.put)
    transport.send(Submit(EngineRequest("r0", prompt, params)))
    tokens = []
    while True:
        report = outputs.get(timeout=60)
        assert isinstance(report, StepReport), report
        for delta in report.deltas:
            tokens.extend(delta.token_ids)
        if any(d.finished for d in report.deltas):
            break
    assert tokens == expected
    transport.stop()
    assert transport.exit_status() == "exit status 0"
    psutil.wait_procs(ranks, timeout=30)
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)


def test_a_follower_exits_when_rank_0_is_killed():
    """SIGKILL skips the exit handlers that end daemon processes: the follower notices alone."""
    import subprocess
    import sys

    import psutil

    script = ("import time; from kvmesh import LLM\n"
              "llm = LLM('random:tiny-qwen3', device='cpu', tensor_parallel_size=2)\n"
              "print(llm.engine._followers.processes[0].pid, flush=True); time.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=str(REPO))
    try:
        follower = psutil.Process(int(rank0.stdout.readline()))
    finally:
        rank0.kill()
        rank0.wait(timeout=30)
    follower.wait(timeout=30)  # psutil.TimeoutExpired if it lingers


def test_the_follower_ranks_stop_with_close_with_the_with_block_and_with_a_plain_exit():
    """README: the other ranks are child processes, started with spawn, stopped by `llm.close()`
    (or leaving `with LLM(...)`) or when the process exits."""
    import subprocess
    import sys

    import psutil

    llm = LLM("random:tiny-qwen3", tensor_parallel_size=2, **ENGINE)
    followers = list(llm.engine._followers.processes)
    assert followers and all(p.is_alive() for p in followers)
    assert all(p._start_method == "spawn" for p in followers)
    llm.close()
    assert not any(p.is_alive() for p in followers)
    with LLM("random:tiny-qwen3", tensor_parallel_size=2, **ENGINE) as llm:
        followers = list(llm.engine._followers.processes)
    assert followers and not any(p.is_alive() for p in followers)
    script = ("from kvmesh import LLM\n"
              "if __name__ == '__main__':\n"
              "    llm = LLM('random:tiny-qwen3', device='cpu', tensor_parallel_size=2)\n"
              "    print(llm.engine._followers.processes[0].pid, flush=True)\n")  # then returns, no close()
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=str(REPO))
    follower = psutil.Process(int(rank0.stdout.readline()))
    assert rank0.wait(timeout=60) == 0
    follower.wait(timeout=30)  # psutil.TimeoutExpired if it outlives its parent's exit


def test_a_follower_that_dies_is_an_error_at_rank_0s_next_step():
    """SERVING.md: a follower that dies is noticed at rank 0's next collective, an error on gloo
    (not a hang): the next generate raises at once."""
    import signal
    import threading

    params = SamplingParams(max_tokens=4, temperature=0)
    with LLM("random:tiny-qwen3", tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=params, use_tqdm=False)[0].token_ids
        follower = llm.engine._followers.processes[0]  # reaped by multiprocessing, as the engine does
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=30)
        assert follower.exitcode == -signal.SIGKILL
        raised = []

        def next_step():
            try:
                llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params, use_tqdm=False)
            except RuntimeError as e:
                raised.append(e)

        step = threading.Thread(target=next_step, daemon=True)
        step.start()
        step.join(timeout=60)
        assert not step.is_alive(), "rank 0 still waits for the dead follower"
        assert raised and "by peer" in str(raised[0]), raised  # closed or reset by peer


def test_a_local_serve_refuses_more_gpus_per_worker_than_the_machine_has(monkeypatch):
    from kvmesh.cluster import launcher

    monkeypatch.setattr(launcher, "_local_gpus", lambda: 1)
    cfg = parse_config({"engine": {"tensor_parallel_size": 2}, "replicas": {"num_gpus": 2}})
    with pytest.raises(ValueError, match=r"replicas.num_gpus is 2 \(engine.tensor_parallel_size 2\) "
                                         r"but this machine has 1 GPU"):
        launcher.fit_to_this_machine(cfg, address=None)
    monkeypatch.setattr(launcher, "_local_gpus", lambda: 2)
    assert launcher.fit_to_this_machine(cfg, address=None) is cfg


def test_a_local_serve_without_a_gpu_runs_cpu_replicas_and_refuses_device_cuda(monkeypatch):
    """README: with no GPU the replicas run on the CPU (device auto asks Ray for no GPU instead of
    waiting forever for one); `device: cuda` there is an error. Joining a cluster (--address) leaves
    the config to that cluster's nodes."""
    import io

    from kvmesh.cluster import launcher
    from kvmesh.cluster.app import worker_options

    monkeypatch.setattr(launcher, "_local_gpus", lambda: 0)
    cfg = parse_config({})  # device auto, one GPU per replica
    out = io.StringIO()
    fitted = launcher.fit_to_this_machine(cfg, address=None, out=out)
    assert fitted.replicas.num_gpus == 0 and fitted.engine.device == "auto"
    assert worker_options(fitted)["ray_actor_options"]["num_gpus"] == 0
    assert fitted.to_dict() == {**cfg.to_dict(), "replicas": {**cfg.to_dict()["replicas"], "num_gpus": 0}}
    assert "no GPU here; running the worker replicas on the CPU" in out.getvalue()

    cuda = parse_config({"engine": {"device": "cuda"}})
    with pytest.raises(ValueError, match=r"engine.device is cuda but this machine has no CUDA GPU"):
        launcher.fit_to_this_machine(cuda, address=None, out=io.StringIO())
    assert launcher.fit_to_this_machine(cuda, address="auto") is cuda
    assert launcher.fit_to_this_machine(cfg, address="auto") is cfg


def test_a_worker_replica_owns_all_its_ranks_gpus():
    """One Ray actor with N GPUs (Ray puts them on one node); its engine process runs the N ranks."""
    from kvmesh.cluster.app import worker_options

    options = worker_options(parse_config({"engine": {"tensor_parallel_size": 2}, "replicas": {"num_gpus": 2}}))
    assert options["ray_actor_options"]["num_gpus"] == 2


def test_the_ranks_listen_on_nothing_beyond_loopback():
    """The group meets through a file, not a tcp:// store (which listens on every interface), and
    gloo's sockets stay on the loopback interface: no rank of a TP engine can be reached from
    another host."""
    import psutil

    def listening(pid: int) -> set:
        return {c.laddr for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN}

    # this test process may already listen for what an earlier test of its worker started (a Ray
    # driver's own servers): only what the TP group opens counts
    before = listening(os.getpid())
    with LLM("random:tiny-qwen3", tensor_parallel_size=2, **ENGINE) as llm:
        opened = (listening(os.getpid()) - before).union(
            *(listening(p.pid) for p in llm.engine._followers.processes))
        assert llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2),
                            use_tqdm=False)[0].token_ids
    assert all(addr.ip in ("127.0.0.1", "::1") for addr in opened), opened


def _blocks_of_rank(rank: int, rendezvous: str, budgets: list[int], results) -> None:
    from kvmesh.worker.kv_sizing import num_kv_blocks
    from kvmesh.worker.tensor_parallel import destroy_group, init_group

    tp = init_group(rank, len(budgets), rendezvous, torch.device("cpu"))
    try:
        config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", block_size=4,
                              kv_cache_memory_bytes=budgets[rank])
        results.put((rank, num_kv_blocks(config, model_config_for("random:tiny-llama"), torch.device("cpu"),
                                         torch.float32, tp)))
    finally:
        destroy_group()


def test_every_rank_holds_the_blocks_of_the_rank_with_the_least_room():
    # rank 0's block ids must exist in every rank's pool (SERVING.md): the least that fits any rank
    import multiprocessing

    from kvmesh.worker.tensor_parallel import rendezvous_file

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    budgets = [64 * 1024, 16 * 1024]  # tiny-llama's 1 KV head on both ranks: 1 KiB a 4-token block
    rendezvous = rendezvous_file()
    procs = [ctx.Process(target=_blocks_of_rank, args=(rank, rendezvous, budgets, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert got == {0: 16, 1: 16}
