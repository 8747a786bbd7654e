"""Metrics of a simulated run, and the oracle hit rate of a trace."""

import numpy as np

from kvmesh.router.sim.capacity import oracle_cached_tokens
from kvmesh.router.sim.cluster import SimResult
from kvmesh.router.sim.workloads import Workload

METRICS = ("hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s",
           "throughput_tok_s", "imbalance", "decision_p50_us", "decision_p99_us", "index_bytes")


def oracle_hit_rate(workload: Workload) -> float:
    """Cached prompt tokens / prompt tokens if every block were cached forever after it was first
    seen (prompt and output blocks of earlier requests), capped one token short like a real hit."""
    cached = oracle_cached_tokens(workload)
    total = sum(r.prompt_len for r in workload.requests)
    return float(cached.sum() / total) if total else 0.0


def summarize(result: SimResult, oracle: float) -> dict:
    jobs = [j for j in result.jobs if j.finish_time is not None]
    if len(jobs) != len(result.jobs):
        raise AssertionError(f"{len(result.jobs) - len(jobs)} requests never finished")
    ttft = np.array([j.first_token_time - j.arrival for j in jobs])
    e2e = np.array([j.finish_time - j.arrival for j in jobs])
    prompt = sum(j.request.prompt_len for j in jobs)
    cached = sum(j.cached_tokens for j in jobs)
    output = sum(j.request.output_len for j in jobs)
    span = max(j.finish_time for j in jobs) - min(j.arrival for j in jobs)
    busy = np.array([w.busy_time for w in result.workers])
    decisions = np.array(result.decision_ns) / 1e3
    cpu = np.array(result.decision_cpu_ns) / 1e3
    index_bytes = result.router.policy.state_bytes()
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "oracle_hit_rate": oracle,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "e2e_p50_s": float(np.percentile(e2e, 50)),
        "e2e_p99_s": float(np.percentile(e2e, 99)),
        "throughput_tok_s": output / span if span > 0 else 0.0,
        "imbalance": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        "decision_p50_us": float(np.percentile(decisions, 50)),
        "decision_p99_us": float(np.percentile(decisions, 99)),
        "decision_p999_us": float(np.percentile(decisions, 99.9)),
        "decision_max_us": float(decisions.max()),
        "decision_cpu_p50_us": float(np.percentile(cpu, 50)) if len(cpu) else None,
        "decision_cpu_p99_us": float(np.percentile(cpu, 99)) if len(cpu) else None,
        "index_bytes": int(index_bytes),
        "requests": len(jobs),
        "idle_while_over_cap": result.violations,
        "index_blocks": result.router.index.num_blocks,
        "wall_s": result.wall_s,
    }
