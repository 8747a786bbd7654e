"""Continuous batching with chunked prefill and preemption by recompute.

No prefill or decode modes: each running request needs num_tokens - num_computed_tokens more. The
token budget (max_num_batched_tokens) is filled by running requests first (decodes, and prompts
already in progress), then by waiting requests' prompt chunks, up to max_num_seqs running. When the
pool runs out of blocks, the newest running request is preempted: its blocks are released and it
goes back to the front of the queue to be recomputed later (its cached prefix usually survives).
"""

from collections import deque
from dataclasses import dataclass

from kvmesh.worker.block_manager import BlockManager
from kvmesh.worker.sequence import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    samples: bool  # the chunk reaches the end of the known tokens: sample the next token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes (1 new token) first, then prompt chunks

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_pending and self._ends_with_pending(request):
                index += 1  # its token in flight is its last: nothing more to compute
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(self._entry(request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the current request was preempted itself: nothing else fits

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                # a waiting request holds no blocks (new, or preempted and released)
                hits = self.block_manager.get_computed_blocks(request)
                num_computed = len(hits) * self.block_manager.block_size
                num_new = min(request.num_tokens - num_computed, budget)
                if not self.block_manager.allocate_slots(request, num_new, hits):
                    break
                self.waiting.popleft()
                request.num_computed_tokens = num_computed
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = num_computed
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled.append(self._entry(request, num_new))
                budget -= num_new

        scheduled.sort(key=lambda s: s.num_new_tokens != 1 or not s.samples)  # decodes first (stable)
        return SchedulerOutput(scheduled)

    def _ends_with_pending(self, request: Request) -> bool:
        return (len(request.output_token_ids) >= request.sampling_params.max_tokens
                or (self.max_model_len is not None and request.num_tokens >= self.max_model_len))

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(request, num_new, request.num_computed_tokens + num_new == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def advance(self, output: SchedulerOutput) -> None:
        """The step is launched: its tokens count as computed (their K/V is written in stream order
        before any later step reads it)."""
        for entry in output.scheduled:
            entry.request.num_computed_tokens += entry.num_new_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks whose tokens are all known."""
        if not request.is_finished:
            self.block_manager.cache_full_blocks(request)

    def finish(self, request: Request) -> None:
        """Remove a request (finished or aborted) and release its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
