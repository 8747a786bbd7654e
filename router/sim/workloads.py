"""Seeded workload generators: the same trace for every policy.

A trace is a list of `SimRequest`s. Token ids are real (drawn from the vocabulary with numpy), and each
request's blocks are hashed with kvmesh.hashing over prompt + output, so the simulated workers and the
router agree on hashes exactly as a real worker and router do. Requests that share a prefix share its
token array and its hash array (continuing the chain with `parent_hash`), which keeps a 20k-request
trace small.

Arrival times are set by `assign_arrivals(trace, rate)`: Poisson for independent requests; for
`multiturn`, conversations start as a Poisson process and each next turn is sent `think_time_s` after
the previous answer finished (a user cannot send turn k+1 before reading answer k).
"""

from array import array
from dataclasses import dataclass, field

import numpy as np

from kvmesh.hashing import block_hashes, hash_array

VOCAB = 151936


@dataclass
class SimRequest:
    request_id: int
    tokens: np.ndarray  # [>= prompt_len + output_len] int32: prompt, then the output it will produce
    prompt_len: int
    output_len: int
    hashes: np.ndarray  # [(prompt_len + output_len) // block_size] uint64: chained block hashes
    session_key: str | None = None
    group: int = 0  # tenant / conversation / prefix id (for reports)
    after: int | None = None  # previous turn of the same conversation
    think_time_s: float = 0.0
    arrival: float = 0.0  # seconds; for a follow-up turn, set when the previous turn finishes
    start_offset: float = 0.0  # unit-rate arrival time (scaled by 1 / rate)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens[:self.prompt_len].tolist()

    def prompt_hashes(self, block_size: int) -> array:
        """The prompt's full blocks' hashes as the router keeps them (kvmesh.hashing.hash_array):
        from the uint64 array in one copy of bytes (~1 us for 500), not an int object per hash."""
        return hash_array(self.hashes[:self.prompt_len // block_size])


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    block_size: int
    params: dict = field(default_factory=dict)

    @property
    def has_followups(self) -> bool:
        return any(r.after is not None for r in self.requests)

    def mean_prompt_tokens(self) -> float:
        return float(np.mean([r.prompt_len for r in self.requests]))

    def mean_output_tokens(self) -> float:
        return float(np.mean([r.output_len for r in self.requests]))


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def _hash(tokens: np.ndarray, block_size: int, prefix: np.ndarray | None = None,
          prefix_tokens: int = 0) -> np.ndarray:
    """Hashes of all full blocks of `tokens`, reusing `prefix` (the hashes of its first
    `prefix_tokens` tokens, a whole number of blocks) instead of recomputing them."""
    num_prefix_blocks = prefix_tokens // block_size
    if prefix is None or num_prefix_blocks == 0:
        return np.array(block_hashes(tokens, block_size), dtype=np.uint64)
    parent = int(prefix[num_prefix_blocks - 1])
    rest = block_hashes(tokens[num_prefix_blocks * block_size:], block_size, parent_hash=parent)
    return np.concatenate([prefix[:num_prefix_blocks], np.array(rest, dtype=np.uint64)])


def _poisson_offsets(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0, size=n))


def tenants(num_requests: int, seed: int = 0, block_size: int = 16, num_tenants: int = 128,
            system_tokens: int = 8192, suffix_tokens: tuple[int, int] = (64, 512),
            output_tokens: tuple[int, int] = (16, 128), users_per_tenant: int = 32,
            tenant_skew: float = 0.5) -> Workload:
    """T tenants, each with a system prompt of S tokens shared by its users; Zipf(tenant_skew)
    popularity over tenants; each request = system prompt + a user message, Poisson arrivals."""
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, system_tokens) for _ in range(num_tenants)]
    system_hashes = [_hash(s, block_size) for s in systems]
    weights = 1.0 / np.arange(1, num_tenants + 1) ** tenant_skew
    tenant_of = rng.choice(num_tenants, size=num_requests, p=weights / weights.sum())
    offsets = _poisson_offsets(rng, num_requests)
    requests = []
    for i in range(num_requests):
        t = int(tenant_of[i])
        suffix = int(rng.integers(suffix_tokens[0], suffix_tokens[1] + 1))
        out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        tokens = np.concatenate([systems[t], _tokens(rng, suffix + out)])
        user = int(rng.integers(users_per_tenant))
        requests.append(SimRequest(
            request_id=i, tokens=tokens, prompt_len=system_tokens + suffix, output_len=out,
            hashes=_hash(tokens, block_size, system_hashes[t], system_tokens),
            session_key=f"tenant-{t}/user-{user}", group=t, start_offset=float(offsets[i])))
    return Workload("tenants", requests, block_size, dict(
        num_tenants=num_tenants, system_tokens=system_tokens, suffix_tokens=suffix_tokens,
        output_tokens=output_tokens, users_per_tenant=users_per_tenant, tenant_skew=tenant_skew))


def multiturn(num_requests: int, seed: int = 0, block_size: int = 16, system_tokens: int = 1024,
              first_message_tokens: tuple[int, int] = (500, 4000),
              message_tokens: tuple[int, int] = (100, 1500), output_tokens: tuple[int, int] = (32, 384),
              turns: tuple[int, int] = (3, 12), think_time_s: float = 1.0) -> Workload:
    """Conversations whose next turn's prompt is the previous prompt + its answer + a new message.
    All conversations share one short system prompt; the session key is the conversation."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_tokens)
    requests: list[SimRequest] = []
    conv = 0
    conv_offsets = _poisson_offsets(rng, num_requests)
    while len(requests) < num_requests:
        num_turns = min(int(rng.integers(turns[0], turns[1] + 1)), num_requests - len(requests))
        msg = int(rng.integers(first_message_tokens[0], first_message_tokens[1] + 1))
        outs = rng.integers(output_tokens[0], output_tokens[1] + 1, size=num_turns)
        msgs = [msg] + [int(rng.integers(message_tokens[0], message_tokens[1] + 1))
                        for _ in range(num_turns - 1)]
        # The whole conversation's tokens: every turn's prompt is a prefix of this array.
        pieces = [system]
        for m, o in zip(msgs, outs):
            pieces.append(_tokens(rng, m + int(o)))
        tokens = np.concatenate(pieces)
        hashes = _hash(tokens, block_size)
        prompt_len, prev = system_tokens, None
        for k in range(num_turns):
            prompt_len += msgs[k]
            out = int(outs[k])
            total_blocks = (prompt_len + out) // block_size
            rid = len(requests)
            requests.append(SimRequest(
                request_id=rid, tokens=tokens, prompt_len=prompt_len, output_len=out,
                hashes=hashes[:total_blocks], session_key=f"conversation-{conv}", group=conv,
                after=prev, think_time_s=think_time_s * float(rng.exponential(1.0)) if k else 0.0,
                start_offset=float(conv_offsets[conv])))
            prompt_len += out
            prev = rid
        conv += 1
    return Workload("multiturn", requests, block_size, dict(
        system_tokens=system_tokens, first_message_tokens=first_message_tokens,
        message_tokens=message_tokens, output_tokens=output_tokens, turns=turns,
        think_time_s=think_time_s, conversations=conv))


def prefix_repetition(num_requests: int, seed: int = 0, block_size: int = 16,
                      num_prefixes: int = 32, prefix_tokens: int = 2048, suffix_tokens: int = 256,
                      output_tokens: int = 128) -> Workload:
    """vLLM's prefix_repetition benchmark: P random prefixes; each request = one prefix (uniform) +
    a fresh random suffix; fixed output length."""
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_tokens) for _ in range(num_prefixes)]
    prefix_hashes = [_hash(p, block_size) for p in prefixes]
    offsets = _poisson_offsets(rng, num_requests)
    requests = []
    for i in range(num_requests):
        p = int(rng.integers(num_prefixes))
        tokens = np.concatenate([prefixes[p], _tokens(rng, suffix_tokens + output_tokens)])
        requests.append(SimRequest(
            request_id=i, tokens=tokens, prompt_len=prefix_tokens + suffix_tokens,
            output_len=output_tokens, hashes=_hash(tokens, block_size, prefix_hashes[p], prefix_tokens),
            session_key=None, group=p, start_offset=float(offsets[i])))
    return Workload("prefix_repetition", requests, block_size, dict(
        num_prefixes=num_prefixes, prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
        output_tokens=output_tokens))


def random_prompts(num_requests: int, seed: int = 0, block_size: int = 16,
                   prompt_tokens: tuple[int, int] = (128, 2048),
                   output_tokens: tuple[int, int] = (16, 256)) -> Workload:
    """No sharing at all: every prompt is fresh random tokens."""
    rng = np.random.default_rng(seed)
    offsets = _poisson_offsets(rng, num_requests)
    requests = []
    for i in range(num_requests):
        prompt = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        tokens = _tokens(rng, prompt + out)
        requests.append(SimRequest(
            request_id=i, tokens=tokens, prompt_len=prompt, output_len=out,
            hashes=_hash(tokens, block_size), group=i, start_offset=float(offsets[i])))
    return Workload("random", requests, block_size, dict(prompt_tokens=prompt_tokens,
                                                         output_tokens=output_tokens))


WORKLOADS = {
    "tenants": tenants,
    "multiturn": multiturn,
    "prefix_repetition": prefix_repetition,
    "random": random_prompts,
}


def make_workload(name: str, num_requests: int, seed: int = 0, block_size: int = 16,
                  **options) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"requests must be >= 1, got {num_requests}")
    return WORKLOADS[name](num_requests, seed=seed, block_size=block_size, **options)


def assign_arrivals(workload: Workload, rate: float, followups: str = "closed") -> None:
    """Scale the unit-rate offsets to `rate` requests/s (conversations start at rate / mean turns).

    followups="closed" (the simulator): a follow-up turn's arrival is left NaN and set at run time to
    the previous turn's finish + its think time. "open" (for a load generator that does not wait for
    answers): previous turn's arrival + its think time, fixed now."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if followups not in ("closed", "open"):
        raise ValueError(f"followups must be 'closed' or 'open', got {followups!r}")
    reqs = workload.requests
    if workload.has_followups:
        num_convs = sum(1 for r in reqs if r.after is None)
        conv_rate = rate * num_convs / len(reqs)
        by_id = {r.request_id: r for r in reqs}
        for r in reqs:  # a conversation's turns come in order, after their predecessor
            if r.after is None:
                r.arrival = r.start_offset / conv_rate
            elif followups == "open":
                r.arrival = by_id[r.after].arrival + r.think_time_s
            else:
                r.arrival = float("nan")
    else:
        for r in reqs:
            r.arrival = r.start_offset / rate
