"""What the ingress sends a worker replica: the engine request plus what the request router reads.

It is the first positional argument of the worker's `generate` handle call, so the custom request
router sees it as `pending_request.args[0]` (block hashes, prompt length, session key) before the
request is sent anywhere.
"""

from dataclasses import dataclass, field

from kvmesh.sampling_params import SamplingParams


@dataclass
class RoutedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_hashes: list[int] = field(default_factory=list)  # full prompt blocks, model-salted
    hash_block_size: int | None = None  # the block size block_hashes were cut at (None: not hashed)
    session_key: str | None = None
    arrival_time: float = 0.0
    attempt: int = 0  # retries after a worker died before producing a token
    avoid_workers: list[str] = field(default_factory=list)  # workers whose engine died under this request
    cache_salt: str | None = None  # vLLM's: block_hashes are salted with it too (hashing.tenant_salt)
    priority: int = 0  # vLLM's: the worker's queue order under engine.scheduling_policy "priority"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class ModelInfo:
    """What the ingress needs to know about the served model (asked of any worker once)."""
    model_name: str
    max_model_len: int
    block_size: int
    hash_salt: bytes
    eos_token_id: int | None = None
    vocab_size: int | None = None
