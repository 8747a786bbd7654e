"""The kv_events cost of sending a request to each worker, in prefill-token equivalents.

cost_w = prefill * (prompt tokens - cached_w)                  new prefill work after the cached prefix
       + queued_prefill * waiting_prefill_tokens_w             work queued ahead of it
       + running_decode * running_decode_tokens_w              decode steps it shares (KV read per step)
       + kv_pressure * kv_usage_w ** 2                         evictions / preemption as the pool fills
       + outstanding * (running_w + waiting_w)                  work the requests in flight will bring back

Units are queued prefill tokens: one delays the request by one token's prefill. A new (uncached)
prefill token weighs 2: it delays the request as much, and it also spends cluster capacity and KV
space on a copy of a prefix another worker already holds, which load-only routing ignores. (The
kv_events policy charges new work behind a short shared prefix the delay alone: KVEventsPolicy.weights_for.) A running
context token makes every step the request shares read 114,688 more bytes (Qwen3-0.6B shape), ~27 ns
at 4.23 TB/s against ~3 us per prefill token (~0.01), over the several steps of its prefill and first
decodes: 0.05. A request in flight weighs 256 more: the token columns are a snapshot (a queued prefill
drains in a step or two), while a request in flight keeps the worker busy for its whole decode, and
its follow-up turn returns to the worker that holds its context; without it, new conversations pile
onto workers whose conversations are momentarily between turns.

`stay_margin` is hysteresis, applied by the kv_events policy after the cost: when the cheapest worker
does not hold the request's longest cached prefix, the cheapest worker that does still gets the
request unless it costs more than `stay_margin` (8192 tokens, one engine step's token budget) above
the best. Loads are reports at least one step old, and a difference smaller than what a worker clears
in a step is noise; acting on it recomputes a whole prefix elsewhere and leaves its copy dead on the
holder (on multiturn, ~1% of follow-up turns moved for a transient queue, costing 0.14 points of hit
rate and no tail latency).

The hysteresis applies only to a continuation: a request whose longest cached prefix is at least
`stay_min_cached` (half) of its prompt, such as a conversation's next turn. A request that is mostly
new work behind a short shared prefix (a new conversation behind a system prompt) is placed by the
cost alone: holding it to the few workers that happen to have the shared prefix piles new work onto
them (on multiturn, the first conversations all went to the first workers that held the system
prompt, whose turns then came back to an overloaded worker and had to move), while the cost already
counts the shared prefix's recompute. The defaults were chosen on the simulator's tenants and
multiturn traces (docs/ROUTING.md has the comparison, docs/LOG.md the variants that failed).

`in_flight` credits a worker with the prompt tokens it is computing right now for an earlier request
that shares them (kvmesh.router.pending), at half the prefill weight: of the 2 a new prefill token
weighs, 1 is the delay (as a queued token) and 1 the second copy it leaves. Sent to the worker
computing the prefix, the request saves the copy but not the delay: the worker computes the blocks
again alongside (a block is shared only once computed). Full credit piled the requests of a cold
popular prefix onto one worker (1024 simulated workers, tenants: hit rate 0.891 -> 0.835).
"""

from dataclasses import dataclass

import numpy as np

from kvmesh.router.load_order import LoadKey
from kvmesh.router.workers import LoadColumns


@dataclass(frozen=True)
class CostWeights:
    prefill: float = 2.0  # per uncached prompt token
    queued_prefill: float = 1.0  # per prompt token already waiting on the worker
    running_decode: float = 0.05  # per context token of the worker's running requests
    kv_pressure: float = 512.0  # tokens-equivalent of a completely full KV pool
    outstanding: float = 256.0  # per request in flight (running + waiting) on the worker
    stay_margin: float = 8192.0  # min cost saved to leave the cheapest holder of the longest prefix
    stay_min_cached: float = 0.5  # the margin applies when that prefix is >= this fraction of the prompt
    in_flight: float = 1.0  # credit per prompt token the worker is computing for an earlier request

    def __post_init__(self):
        for name in ("prefill", "queued_prefill", "running_decode", "kv_pressure", "outstanding",
                     "stay_margin", "stay_min_cached", "in_flight"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostWeights.{name} must be >= 0, got {getattr(self, name)}")


def worker_costs(num_prompt_tokens: int, cached_tokens: np.ndarray, cols: LoadColumns,
                 weights: CostWeights, rows: np.ndarray | None = None) -> np.ndarray:
    """[n] cost per worker; `cached_tokens[i]` = prompt tokens worker i holds (leading blocks).
    With `rows`: [len(rows)] the cost of those rows only (`cached_tokens` aligned with `rows`)."""
    def column(values: np.ndarray) -> np.ndarray:
        return values if rows is None else values[rows]

    cost = weights.prefill * (num_prompt_tokens - cached_tokens)
    if weights.queued_prefill:
        cost += weights.queued_prefill * column(cols.waiting_prefill_tokens)
    if weights.running_decode:
        cost += weights.running_decode * column(cols.running_decode_tokens)
    if weights.kv_pressure:
        cost += weights.kv_pressure * np.square(column(cols.kv_usage))
    if weights.outstanding:
        cost += weights.outstanding * column(cols.outstanding)
    return cost


def worker_cost(num_prompt_tokens: int, cached_tokens: float, key: LoadKey, weights: CostWeights) -> float:
    """worker_costs of one worker whose load is `key`, bit for bit: the same terms added in the same
    order, in Python floats (a few workers' costs without numpy's per-call overhead)."""
    cost = weights.prefill * (num_prompt_tokens - cached_tokens)
    if weights.queued_prefill:
        cost += weights.queued_prefill * key.waiting_prefill_tokens
    if weights.running_decode:
        cost += weights.running_decode * key.running_decode_tokens
    if weights.kv_pressure:
        cost += weights.kv_pressure * (key.kv_usage * key.kv_usage)
    if weights.outstanding:
        cost += weights.outstanding * key.outstanding
    return cost


def load_cost(key: LoadKey, weights: CostWeights) -> float:
    """The part of every worker's cost that does not depend on the request: the order of the workers
    that hold none of its prefix (kvmesh.router.load_order). Equal to worker_costs minus the prefill
    term up to float rounding (the terms are summed in another order)."""
    return (weights.queued_prefill * key.waiting_prefill_tokens
            + weights.running_decode * key.running_decode_tokens
            + weights.kv_pressure * key.kv_usage * key.kv_usage
            + weights.outstanding * key.outstanding)
