"""Router at scale: decision latency with 1024 workers and the memory of a 1M-block index.

    python -m kvmesh.router.sim.scale --workers 1024 --blocks 1000000 --decisions 20000 [--json]

Fills a Router's index through real KVEventBatch messages: `--prefixes` shared prompts of
`--prefix-blocks` blocks, each cached on `--replicas` workers, then per-worker unique chains until the
index holds `--blocks` distinct hashes. Memory is the process's resident-set growth while filling
(after a collection), next to the index's own estimate. Then it times `Router.route` (wall clock,
lock included; and the thread's CPU time, which a busy shared machine does not inflate) for requests =
one shared prefix + a fresh suffix, while worker loads keep changing.
"""

import argparse
import gc
import json
import random
import sys
import time

import numpy as np

from kvmesh.hashing import block_hashes
from kvmesh.protocol import BlockStored, KVEventBatch, WorkerLoad
from kvmesh.router import Router

VOCAB = 151936


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _chain(rng: np.random.Generator, num_blocks: int, block_size: int) -> list[int]:
    return block_hashes(rng.integers(0, VOCAB, num_blocks * block_size, dtype=np.int32), block_size)


def measure(num_workers: int = 1024, num_blocks: int = 1_000_000, num_decisions: int = 20000,
            num_prefixes: int = 1024, prefix_blocks: int = 256, suffix_blocks: int = 32,
            replicas: int = 3, block_size: int = 16, policy: str = "kv_events", seed: int = 0,
            progress: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    pyrng = random.Random(seed)
    router = Router(policy=policy, block_size=block_size, max_blocks=num_blocks, seed=seed, default_cap=256)
    workers = [f"worker-{i}" for i in range(num_workers)]
    for w in workers:
        router.add_worker(w)
    seqs = dict.fromkeys(workers, 0)

    def send(worker: str, hashes: list[int]) -> None:
        ok = router.on_events(KVEventBatch(worker, 0, seqs[worker],
                                           [BlockStored(hashes, None, len(hashes) * block_size)]))
        assert ok
        seqs[worker] += 1

    prefixes = [_chain(rng, prefix_blocks, block_size) for _ in range(num_prefixes)]
    gc.collect()
    rss_before = _rss_bytes()
    fill_start = time.perf_counter()
    for p in prefixes:
        for w in pyrng.sample(workers, replicas):
            send(w, p)
    # Unique chains (other prompts and outputs) spread over the workers until the index is full.
    i = 0
    while router.index.num_blocks < num_blocks:
        need = min(256, num_blocks - router.index.num_blocks)
        send(workers[i % num_workers], _chain(rng, need, block_size))
        i += 1
    fill_s = time.perf_counter() - fill_start
    del prefixes[num_prefixes // 2:]  # keep some to query; drop the rest before measuring memory
    gc.collect()
    index_rss = _rss_bytes() - rss_before
    approx = router.index.approx_bytes()

    loads = [WorkerLoad(w, running=int(rng.integers(0, 64)), waiting=int(rng.integers(0, 4)),
                        waiting_prefill_tokens=int(rng.integers(0, 8192)),
                        running_decode_tokens=int(rng.integers(0, 500_000)),
                        kv_free_blocks=int(rng.integers(0, 70_000)), kv_total_blocks=71_381)
             for w in workers]
    for load in loads:
        router.update_load(load)
    requests = []
    for _ in range(256):
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        suffix = block_hashes(rng.integers(0, VOCAB, suffix_blocks * block_size, dtype=np.int32),
                              block_size, parent_hash=prefix[-1])
        requests.append(prefix + suffix)
    num_tokens = (prefix_blocks + suffix_blocks) * block_size
    times = np.empty(num_decisions)
    cpu_times = np.empty(num_decisions)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=num_decisions, desc="decisions", file=sys.stderr, leave=False,
                   mininterval=0.5, disable=None)
    hits = 0
    for k in range(num_decisions):
        for _ in range(8):  # the load stream keeps flowing between decisions
            load = loads[int(rng.integers(num_workers))]
            load.running = int(rng.integers(0, 64))
            router.update_load(load)
        hashes = requests[k % len(requests)]
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        ranked = router.route(hashes, num_tokens)
        times[k] = time.perf_counter_ns() - t0
        cpu_times[k] = time.thread_time_ns() - c0
        hits += router.index.overlap(hashes, [ranked[0]]).get(ranked[0], 0) >= prefix_blocks
        if bar is not None and k % 1000 == 999:
            bar.update(1000)
    if bar is not None:
        bar.close()
    us = times / 1e3
    return {
        "workers": num_workers,
        "policy": policy,
        "index_blocks": router.index.num_blocks,
        "index_rss_bytes": int(index_rss),
        "index_approx_bytes": int(approx),
        "index_bytes_per_block": index_rss / router.index.num_blocks,
        "fill_s": fill_s,
        "fill_blocks_per_s": router.index.num_blocks / fill_s,
        "decisions": num_decisions,
        "prompt_blocks": prefix_blocks + suffix_blocks,
        "decision_p50_us": float(np.percentile(us, 50)),
        "decision_p99_us": float(np.percentile(us, 99)),
        "decision_p999_us": float(np.percentile(us, 99.9)),
        "decision_max_us": float(us.max()),
        # CPU time of the routing thread: what the decision costs without other processes' preemption
        "decision_cpu_p50_us": float(np.percentile(cpu_times, 50) / 1e3),
        "decision_cpu_p99_us": float(np.percentile(cpu_times, 99) / 1e3),
        "routed_to_a_prefix_holder": hits / num_decisions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.router.sim.scale", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--decisions", type=int, default=20000)
    p.add_argument("--policy", default="kv_events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args.workers, args.blocks, args.decisions, policy=args.policy, seed=args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value:,.3f}" if isinstance(value, float) else f"{key:28s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
