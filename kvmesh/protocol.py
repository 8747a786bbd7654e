"""Types that cross process boundaries: plain dataclasses of ints, floats, strings and lists.

Worker -> router: KVEventBatch (numbered per worker epoch), KVSnapshot (on resync), WorkerLoad.
Ingress -> worker -> ingress: EngineRequest in, TokenDelta out (streamed), RequestOutput (final,
offline API). Never a tensor.
"""

from dataclasses import dataclass, field

from kvmesh.sampling_params import SamplingParams


# ---- KV events -------------------------------------------------------------------------------

@dataclass
class BlockStored:
    """Full blocks that became cached, in chain order; parent_hash is the block before the first."""
    block_hashes: list[int]
    parent_hash: int | None
    num_tokens: int  # tokens covered by these blocks (len(block_hashes) * block_size)


@dataclass
class BlockRemoved:
    """Blocks whose cached content was evicted (their slots were reused)."""
    block_hashes: list[int]


@dataclass
class AllCleared:
    """The worker dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass
class KVEventBatch:
    """Events of one engine step. `epoch` changes when the worker (re)starts; `seq` counts batches
    within an epoch from 0 with no gaps, so a consumer can tell when it missed one."""
    worker_id: str
    epoch: int
    seq: int
    events: list[KVEvent]
    timestamp: float = 0.0


@dataclass
class KVSnapshot:
    """Every block hash a worker holds, as of batch `seq` of `epoch` (the next batch is seq + 1)."""
    worker_id: str
    epoch: int
    seq: int
    block_hashes: list[int]
    block_size: int = 16


# ---- load ------------------------------------------------------------------------------------

@dataclass
class WorkerLoad:
    worker_id: str
    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    running_decode_tokens: int = 0  # context tokens of running requests (KV read per decode step)
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    healthy: bool = True  # False once the worker's engine is dead (the replica is being replaced)
    timestamp: float = 0.0
    # The engine has requests but has not finished a step for `replicas.engine_stall_timeout_s`:
    # routers rank this worker after the others until it steps again.
    stalled: bool = False

    @property
    def kv_usage(self) -> float:
        if self.kv_total_blocks == 0:
            return 0.0
        return 1.0 - self.kv_free_blocks / self.kv_total_blocks


# ---- requests and outputs --------------------------------------------------------------------

@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    prompt: str | None = None
    # False: the engine returns no text deltas (the caller decodes the finished token ids once);
    # stop strings still work. Offline batch generation uses it to keep detokenizing off the step.
    stream_text: bool = True
    # The prompt's full-block hashes (kvmesh.hashing.block_hashes with the engine's salt) where the
    # caller has them already (the ingress hashes every prompt to route it), cut at
    # `hash_block_size` tokens; the engine checks that size against its own and hashes the prompt
    # itself only when they are absent (offline use).
    block_hashes: list[int] | None = None
    hash_block_size: int | None = None
    # vLLM's cache_salt: the request's blocks are hashed under it too (hashing.tenant_salt), so it
    # shares cached blocks only with requests of the same salt
    cache_salt: str | None = None
    # vLLM's priority: lower runs first under the engine's "priority" scheduling policy; under
    # "fcfs" (the default) anything but 0 is refused
    priority: int = 0


class PromptSizeError(ValueError):
    """A prompt no engine of that max_model_len can run (`too_long`: else it is empty)."""

    def __init__(self, message: str, too_long: bool):
        super().__init__(message)
        self.too_long = too_long


def check_prompt_size(num_tokens: int, max_model_len: int) -> None:
    """The one prompt-length rule: at least 1 token, and room left for 1 generated token. The
    ingress applies it before any work (a 400 naming the field); the engine applies it again to
    every request it is handed, so a caller that reaches it directly (kvmesh.LLM) is refused too."""
    if num_tokens == 0:
        raise PromptSizeError("the prompt is empty: it must contain at least 1 token", too_long=False)
    if num_tokens >= max_model_len:
        raise PromptSizeError(f"the prompt is {num_tokens} tokens; the limit is {max_model_len - 1} "
                              f"(max_model_len {max_model_len} minus 1 generated token)", too_long=True)


@dataclass
class PromptLogprobs:
    """Each prompt token's log-probability given the tokens before it (vLLM's prompt_logprobs):
    entry 0 is None (the first token has no context). `ranks[i]` is token i's rank in its
    distribution (1 = the most likely); `top[i]` the top-k alternatives, token id -> logprob."""
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[dict[int, float] | None]


@dataclass
class TokenDelta:
    """What one engine step produced for one request (streamed to the caller)."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including these
    logprobs: list[float] | None = None  # of each sampled token in token_ids
    top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    first_token_time: float | None = None
    arrival_time: float = 0.0
    # With finish_reason "error": the worker's engine died, not the request; another worker may run it.
    retryable: bool = False
    # With SamplingParams.prompt_logprobs: on the request's first delta that has a token.
    prompt_logprobs: PromptLogprobs | None = None
    # Parallel sampling (n > 1, best_of): the sequence these tokens belong to, and whether other
    # sequences of the request still run. finish_reason is the sequence's; the request is
    # finished with the last sequence.
    index: int = 0
    more_sequences: bool = False
    # vLLM's: with finish_reason "stop", the stop string or stop token id that ended it (None: EOS)
    stop_reason: str | int | None = None
    scheduled_time: float | None = None  # when the engine first scheduled it (the worker's clock)
    # When each of token_ids was sampled (the worker's clock): the inter-token gaps vLLM's
    # inter_token_latency_seconds observes, kept apart when a slow reader gets deltas merged
    token_times: list[float] | None = None
    # With logprobs / prompt_logprobs: the text of every token id those name (the engine process
    # decodes; the ingress looks them up)
    token_texts: dict[int, str] | None = None
    worker_id: str = ""  # the worker replica that made these tokens ("": a delta the ingress made)

    @property
    def finished(self) -> bool:
        """The request is finished (with n > 1: its last sequence)."""
        return self.finish_reason is not None and not self.more_sequences

    def followed_by(self, later: "TokenDelta") -> "TokenDelta":
        """This delta and the next one of the same request as one delta (what a consumer that fell
        behind the engine receives: one stream item per read instead of one per step)."""
        if later.request_id != self.request_id:
            raise ValueError(f"request_id: cannot merge deltas of {self.request_id!r} and {later.request_id!r}")
        if later.index != self.index:
            raise ValueError(f"index: cannot merge deltas of sequences {self.index} and {later.index}")
        return TokenDelta(
            self.request_id, self.token_ids + later.token_ids, self.text + later.text,
            later.finish_reason, later.num_prompt_tokens or self.num_prompt_tokens,
            later.num_cached_tokens or self.num_cached_tokens, later.num_output_tokens,
            _joined(self.logprobs, later.logprobs), _joined(self.top_logprobs, later.top_logprobs),
            later.error or self.error,
            self.first_token_time if self.first_token_time is not None else later.first_token_time,
            self.arrival_time or later.arrival_time, later.retryable,
            self.prompt_logprobs or later.prompt_logprobs, self.index, later.more_sequences,
            later.stop_reason,
            self.scheduled_time if self.scheduled_time is not None else later.scheduled_time,
            _joined(self.token_times, later.token_times),
            _merged_texts(self.token_texts, later.token_texts), later.worker_id or self.worker_id)


def _merged_texts(a: dict | None, b: dict | None) -> dict | None:
    return a if not b else b if not a else {**a, **b}


def _joined(a: list | None, b: list | None) -> list | None:
    return None if a is None and b is None else (a or []) + (b or [])


@dataclass
class RequestOutput:
    """A finished request, as the offline `LLM.generate` returns it."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    # n > 1: the n sequences (with best_of, the n best by cumulative logprob, best first); the
    # fields above are sequences[0]'s. Empty when n is 1.
    sequences: list["RequestOutput"] = field(default_factory=list)
    stop_reason: str | int | None = None  # as TokenDelta.stop_reason
