"""A request's state inside the engine."""

import enum
import time

import torch

from kvmesh.hashing import block_hashes as compute_block_hashes, hash_block, root_hash
from kvmesh.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 block_size: int, salt: bytes, arrival_time: float | None = None,
                 prompt: str | None = None, prompt_block_hashes: list[int] | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.salt = salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache (or hit)
        self.num_cached_tokens: int | None = None  # prompt tokens served by the cache, first schedule
        # The prompt's are given when the ingress hashed it already (to route it); later ones are
        # appended as output tokens fill blocks.
        self.block_hashes: list[int] = (list(prompt_block_hashes) if prompt_block_hashes is not None
                                        else compute_block_hashes(prompt_token_ids, block_size, salt))
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = 0  # lower is scheduled first under the "priority" policy (worker/scheduler.py)
        self.arrival_index = 0  # the scheduler's count of arrivals: ties of priority go in this order
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None  # first scheduled (its queue time ends)
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.generator: torch.Generator | None = None  # per-request, for seeded sampling
        # SamplingParams.prompt_logprobs: the prompt tokens scored so far (worker/prompt_logprobs.py),
        # sent with the first delta that has a token.
        self.prompt_logprobs = None
        self.prompt_logprobs_sent = False
        self.detokenizer = None  # set by the engine
        self.grammar = None  # structured outputs: a worker.grammar.GrammarMatcher, set by the engine
        self.bad_word_ids: list[list[int]] = []  # bad_words tokenized (worker/bad_words.py), by the engine
        # Async scheduling: the token sampled by the step in flight is a placeholder (-1) at the end
        # of the token lists until its step is processed; pending_row is its row in that step's
        # sampled tokens, from which the next step reads it on the device.
        self.num_pending = 0
        self.pending_row = -1
        # Parallel sampling (worker/parallel_sampling.py): this sequence's index among the
        # request's, every sequence of the request (shared list; None when it has one), and the
        # sequences that fork off this one when its prompt is computed.
        self.index = 0
        self.group: list[Request] | None = None
        self.pending_forks: list[Request] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_resolved_output_tokens(self) -> int:
        return len(self.output_token_ids) - self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._hash_full_blocks()

    def append_placeholder(self, row: int) -> None:
        self.output_token_ids.append(-1)
        self.all_token_ids.append(-1)
        self.num_pending += 1
        self.pending_row = row

    def resolve_placeholder(self, token_id: int) -> None:
        """The oldest pending token is now known."""
        index = len(self.output_token_ids) - self.num_pending
        self.output_token_ids[index] = token_id
        self.all_token_ids[self.num_prompt_tokens + index] = token_id
        self.num_pending -= 1
        self._hash_full_blocks()

    def drop_placeholders(self) -> None:
        """A request that finished with tokens still in flight: those tokens are discarded."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending:]
            del self.all_token_ids[-self.num_pending:]
            self.num_pending = 0

    def _hash_full_blocks(self) -> None:
        known = len(self.all_token_ids) - self.num_pending
        while (len(self.block_hashes) + 1) * self.block_size <= known:
            parent = self.block_hashes[-1] if self.block_hashes else root_hash(self.salt)
            start = len(self.block_hashes) * self.block_size
            self.block_hashes.append(hash_block(parent, self.all_token_ids[start:start + self.block_size]))
