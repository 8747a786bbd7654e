"""A simulated worker: continuous batching with chunked prefill over a SimKVCache.

Each engine step runs every running decode (one token each) and fills the rest of the token budget
with prompt chunks, first come first served; its duration comes from the CostModel. When no prompt is
being prefilled, the steps until the next request finishes are taken as one "macro" step (their times
summed exactly), which an arriving request interrupts at the next step boundary. Load and KV events
are published after every step, as a real worker would.
"""

import heapq
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

from kvmesh.protocol import KVEventBatch, WorkerLoad
from kvmesh.router.sim.cache import SimKVCache
from kvmesh.router.sim.calibration import CostModel
from kvmesh.router.sim.workloads import SimRequest


@dataclass
class Job:
    """A request on a worker, with what happened to it."""
    request: SimRequest
    arrival: float
    worker_id: str = ""
    est_new_tokens: int = 0  # uncached prompt tokens as estimated when queued
    cached_tokens: int = 0
    prefill_remaining: int = 0
    held: list[int] = field(default_factory=list)  # cached hashes it references
    private_blocks: int = 0
    decode_start_step: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class _Step:
    start: float
    decode_steps: int  # > 1 only for a macro step (decodes only)
    num_decode: int
    chunks: list  # [(job, tokens)]
    cumulative: list[float] | None = None  # macro step: end time of each of its steps, from start


class SimWorker:
    def __init__(self, worker_id: str, cost: CostModel, capacity_blocks: int, max_batch: int,
                 max_batched_tokens: int):
        self.worker_id = worker_id
        self.cost = cost
        self.block_size = cost.block_size
        self.cache = SimKVCache(capacity_blocks, self.block_size)
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Job] = deque()
        self._decoding: list[tuple[int, int, Job]] = []  # heap of (finish step, order, job)
        self._order = 0
        self.step_index = 0
        self._ctx_base = 0  # sum of (prompt_len + 1 - decode_start_step) over decoding jobs
        self.queued_prefill_tokens = 0
        self.step: _Step | None = None
        self.step_end: float | None = None
        self.busy_time = 0.0
        self.seq = 0

    # ---- state -------------------------------------------------------------------------------

    @property
    def num_decoding(self) -> int:
        return len(self._decoding)

    @property
    def running(self) -> int:
        return len(self._decoding) + len(self.prefilling)

    @property
    def outstanding(self) -> int:
        return self.running + len(self.waiting)

    def decode_context_tokens(self) -> int:
        return self._ctx_base + len(self._decoding) * self.step_index

    def load(self, now: float) -> WorkerLoad:
        return WorkerLoad(
            worker_id=self.worker_id, running=self.running, waiting=len(self.waiting),
            waiting_prefill_tokens=self.queued_prefill_tokens,
            running_decode_tokens=self.decode_context_tokens(),
            kv_free_blocks=self.cache.num_free, kv_total_blocks=self.cache.capacity, timestamp=now)

    def take_event_batch(self, now: float) -> KVEventBatch | None:
        events = self.cache.take_events()
        if not events:
            return None
        batch = KVEventBatch(worker_id=self.worker_id, epoch=0, seq=self.seq, events=events, timestamp=now)
        self.seq += 1
        return batch

    # ---- driving -----------------------------------------------------------------------------

    def submit(self, job: Job, now: float) -> float | None:
        """Queue a request. Returns the new end time of the current step if it changed (the caller
        reschedules), else None."""
        request = job.request
        limit = (request.prompt_len - 1) // self.block_size
        hit = self.cache.match(request.hashes[:limit].tolist(), limit)
        job.worker_id = self.worker_id
        job.est_new_tokens = request.prompt_len - hit * self.block_size
        self.queued_prefill_tokens += job.est_new_tokens
        self.waiting.append(job)
        if self.step is None:
            return self._start_step(now)
        if self.step.cumulative is not None:
            return self._truncate_macro(now)
        return None

    def on_step_end(self, now: float) -> tuple[list[Job], list[Job], float | None]:
        """Finish the current step at `now`. Returns (jobs that got their first token, jobs that
        finished, end time of the next step or None when idle)."""
        step = self.step
        self.busy_time += now - step.start
        self.step = None
        started, finished = [], []
        if step.num_decode:
            self.step_index += step.decode_steps
        for job, tokens in step.chunks:
            job.prefill_remaining -= tokens
            self.queued_prefill_tokens -= tokens
            if job.prefill_remaining == 0:
                self.prefilling.remove(job)
                job.first_token_time = now
                started.append(job)
                self._prompt_done(job)
                if job.request.output_len <= 1:
                    self._finish(job, now)
                    finished.append(job)
                else:
                    job.decode_start_step = self.step_index
                    self._ctx_base += job.request.prompt_len + 1 - self.step_index
                    heapq.heappush(self._decoding, (self.step_index + job.request.output_len - 1,
                                                    self._order, job))
                    self._order += 1
        while self._decoding and self._decoding[0][0] <= self.step_index:
            _, _, job = heapq.heappop(self._decoding)
            self._ctx_base -= job.request.prompt_len + 1 - job.decode_start_step
            self._finish(job, now)
            finished.append(job)
        return started, finished, self._start_step(now)

    # ---- internals ---------------------------------------------------------------------------

    def _admit(self) -> None:
        bs = self.block_size
        while self.waiting and self.running < self.max_batch:
            job = self.waiting[0]
            request = job.request
            limit = (request.prompt_len - 1) // bs
            prompt_hashes = request.hashes[:limit].tolist()
            hit = self.cache.match(prompt_hashes, limit)
            total_blocks = -(-(request.prompt_len + request.output_len) // bs)
            if total_blocks > self.cache.capacity:
                raise ValueError(f"request {request.request_id} needs {total_blocks} KV blocks, "
                                 f"more than a worker's {self.cache.capacity}")
            if not self.cache.allocate(prompt_hashes[:hit], total_blocks - hit):
                return  # first come first served: wait for blocks
            self.waiting.popleft()
            job.held = prompt_hashes[:hit]
            job.private_blocks = total_blocks - hit
            job.cached_tokens = hit * bs
            job.prefill_remaining = request.prompt_len - job.cached_tokens
            self.queued_prefill_tokens += job.prefill_remaining - job.est_new_tokens
            self.prefilling.append(job)

    def _prompt_done(self, job: Job) -> None:
        request, bs = job.request, self.block_size
        first, last = len(job.held), request.prompt_len // bs
        if last > first:
            parent = int(request.hashes[first - 1]) if first else None
            stored = self.cache.commit(request.hashes[first:last].tolist(), parent)
            job.held.extend(stored)
            job.private_blocks -= len(stored)

    def _finish(self, job: Job, now: float) -> None:
        request, bs = job.request, self.block_size
        first, last = request.prompt_len // bs, len(request.hashes)
        if last > first:
            parent = int(request.hashes[first - 1]) if first else None
            stored = self.cache.commit(request.hashes[first:last].tolist(), parent)
            job.held.extend(stored)
            job.private_blocks -= len(stored)
        self.cache.release(job.held, job.private_blocks)
        job.held, job.private_blocks = [], 0
        job.finish_time = now

    def _start_step(self, now: float) -> float | None:
        self._admit()
        num_decode = len(self._decoding)
        budget = self.max_batched_tokens - num_decode
        chunks, pairs, sampled = [], 0.0, num_decode
        for job in self.prefilling:
            if budget <= 0:
                break
            tokens = min(job.prefill_remaining, budget)
            done_before = job.request.prompt_len - job.prefill_remaining
            pairs += tokens * (done_before + (tokens + 1) / 2)
            sampled += tokens == job.prefill_remaining
            chunks.append((job, tokens))
            budget -= tokens
        ctx = self.decode_context_tokens()
        if chunks:
            duration = self.cost.step_time(num_decode, ctx, self.max_batched_tokens - num_decode - budget,
                                           pairs, sampled)
            self.step = _Step(now, 1, num_decode, chunks)
        elif num_decode:
            steps = self._decoding[0][0] - self.step_index
            cumulative, total = [], 0.0
            for j in range(steps):
                total += self.cost.decode_step_time(num_decode, ctx + num_decode * j)
                cumulative.append(total)
            duration = total
            self.step = _Step(now, steps, num_decode, [], cumulative)
        else:
            self.step_end = None
            return None
        self.step_end = now + duration
        return self.step_end

    def _truncate_macro(self, now: float) -> float | None:
        """An arrival during a macro step: end it at the next step boundary."""
        step = self.step
        done = bisect_right(step.cumulative, now - step.start)
        keep = min(done + 1, step.decode_steps)
        if keep == step.decode_steps:
            return None
        step.decode_steps = keep
        step.cumulative = step.cumulative[:keep]
        self.step_end = step.start + step.cumulative[-1]
        return self.step_end
