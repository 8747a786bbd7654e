"""Continuous batching with chunked prefill and preemption by recompute.

No prefill or decode modes: each running request needs num_tokens - num_computed_tokens more. The
token budget (max_num_batched_tokens) is filled by running requests first (decodes, and prompts
already in progress), then by waiting requests' prompt chunks, up to max_num_seqs running. When the
pool runs out of blocks, the newest running request is preempted: its blocks are released and it
goes back to the front of the queue to be recomputed later (its cached prefix usually survives).

Under the "priority" policy (vLLM's --scheduling-policy priority) the queue is ordered by each
request's priority (lower first), then by arrival, and the victim of a preemption is the running
request of the lowest priority (the newest among equals) rather than the newest; a preempted request
goes back into the queue at its place in that order. A waiting request does not preempt a running
one: priority decides who is admitted next and who gives way when the pool runs out.
"""

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from kvmesh.config import SCHEDULING_POLICIES
from kvmesh.worker.block_manager import BlockManager
from kvmesh.worker.sequence import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    samples: bool  # the chunk reaches the end of the known tokens: sample the next token
    # Sequences forked off `request` as its prompt completes (parallel sampling): each samples its
    # first token from this chunk's last logits row too (worker/parallel_sampling.py).
    forks: list[Request] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes (1 new token) first, then prompt chunks
    # (src, dst) block ids whose K/V is copied before the forward (copy on write of a shared block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int | None = None, policy: str = "fcfs"):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.by_priority = policy == "priority"
        self._arrivals = itertools.count()
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.arrival_index = next(self._arrivals)
        self._enqueue(request, preempted=False)

    def _enqueue(self, request: Request, preempted: bool) -> None:
        if not self.by_priority:
            (self.waiting.appendleft if preempted else self.waiting.append)(request)
            return
        key = _queue_key(request)
        if not self.waiting or key >= _queue_key(self.waiting[-1]):
            self.waiting.append(request)  # the common case: equal priorities, in arrival order
        else:
            self.waiting.insert(bisect.bisect_right(self.waiting, key, key=_queue_key), request)

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
                processed = self.running[:index]
                victims = self._preempt_victim()
                preempted = True
                # a group's members scheduled earlier in this step are taken back with it
                for entry in [e for e in scheduled if any(e.request is v for v in victims)]:
                    scheduled.remove(entry)
                    budget += entry.num_new_tokens
                if any(request is v for v in victims):
                    # the current request gave way itself: go on after it (under fcfs it was the
                    # newest, so nothing comes after it)
                    index = sum(1 for r in processed if r in self.running)
                    break
                index = self.running.index(request)
            else:
                scheduled.append(self._entry(request, num_new))
                budget -= num_new
                index += 1

        if not preempted:
            # sequences still to fork count against max_num_seqs from their request's admission
            num_seqs = len(self.running) + sum(len(r.pending_forks) for r in self.running)
            while (self.waiting and budget > 0
                   and num_seqs + 1 + len(self.waiting[0].pending_forks) <= self.max_num_seqs):
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
                num_seqs += 1 + len(request.pending_forks)
                scheduled.append(self._entry(request, num_new))
                budget -= num_new

        for entry in scheduled:
            if entry.forks:
                self._fork(entry)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1 or not s.samples)  # decodes first (stable)
        return SchedulerOutput(scheduled, self.block_manager.take_copies())

    def _ends_with_pending(self, request: Request) -> bool:
        return (len(request.output_token_ids) >= request.sampling_params.max_tokens
                or (self.max_model_len is not None and request.num_tokens >= self.max_model_len))

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        samples = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, samples, list(request.pending_forks) if samples else [])

    def _fork(self, entry: ScheduledRequest) -> None:
        """The request's prompt is computed by this step: its other sequences start, sharing its
        blocks, right after it in the running list (a group stays contiguous)."""
        parent = entry.request
        for child in entry.forks:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens + entry.num_new_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.arrival_index = parent.arrival_index
            child.status = RequestStatus.RUNNING
        parent.pending_forks = []
        at = next(i for i, r in enumerate(self.running) if r is parent) + 1
        self.running[at:at] = entry.forks

    def _preempt_victim(self) -> list[Request]:
        """Preempt the newest running request (under "priority": the newest of the lowest priority),
        with the running sequences of its group (they share blocks: one alone frees little).
        Returns them."""
        if self.by_priority:
            at = max(range(len(self.running)), key=lambda i: (*_queue_key(self.running[i]), i))
            chosen = self.running[at]
        else:
            chosen = self.running[-1]
        group = chosen.group
        victims = [r for r in self.running if r.group is group] if group is not None else [chosen]
        # back into the queue in their order: at its front (fcfs), or at their place (priority)
        for victim in (victims if self.by_priority else reversed(victims)):
            self.running.remove(victim)
            self._preempt(victim)
        return victims

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)

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


def _queue_key(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival_index
