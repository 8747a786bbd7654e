"""Paged KV block pool with prefix caching.

Blocks hold `block_size` tokens. A full block that has been computed is registered under its chained
hash (kvmesh.hashing) so a later request with the same prefix reuses it. Free blocks sit in an LRU
list: blocks holding nothing cached are handed out first, then the least recently freed cached
blocks (whose hashes are then evicted). A cached block that is hit while free is revived. The pool
records BlockStored / BlockRemoved / AllCleared events for the router.

The scheduler uses only the request-level methods (get_computed_blocks, allocate_slots,
cache_full_blocks, free, num_free_blocks), shaped like nano-vllm's BlockManager and
vLLM v1's KVCacheManager; the block-level ones below them are the pool's mechanics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.protocol import AllCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from kvmesh.worker.sequence import Request


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to guard against hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool must hold at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.pending_events: list[KVEvent] = []
        # Copy-on-write of shared partial blocks (parallel sampling): (src, dst) block ids whose
        # K/V the runner copies before the step's forward pass.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- a request's block table (the scheduler's API) ---------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached prefix of a request that holds no blocks (new, or preempted): block ids to
        pass to allocate_slots, capped so at least one prompt token is left to compute. None for a
        request that still has prompt tokens to score (prompt_logprobs needs every position)."""
        scores = request.prompt_logprobs
        if scores is not None and len(scores.logprobs) < request.num_prompt_tokens:
            return []
        return self.find_cached_prefix(request.all_token_ids, request.block_hashes)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Grow request.block_ids to hold its computed tokens, the cached `computed_blocks` (from
        get_computed_blocks, for a request being admitted) and `num_new_tokens` more. False,
        changing nothing, when the free list cannot supply the blocks."""
        shared_tail = self._shared_tail(request, num_new_tokens)
        if (not computed_blocks and shared_tail is None and request.num_computed_tokens + num_new_tokens
                <= len(request.block_ids) * self.block_size):
            return True  # a decode with room in its last block: most calls, once per sequence per step
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        needed = max(0, self.blocks_needed(num_tokens) - len(request.block_ids) - len(computed_blocks))
        # cached blocks that are free now are revived: they come off the free list too
        num_revived = sum(1 for block_id in computed_blocks if self.blocks[block_id].ref_count == 0)
        if needed + num_revived + (shared_tail is not None) > len(self._free):
            return False
        if shared_tail is not None:
            self._copy_on_write(request, shared_tail)
        if computed_blocks:
            self.acquire(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_cached_blocks = len(computed_blocks)
        if needed:
            request.block_ids.extend(self.allocate(needed))
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (one more reference each): parallel sampling's
        sequences share their prompt's K/V. The partial last block is copied when one of them
        first writes into it (allocate_slots)."""
        self.acquire(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_cached_blocks = parent.num_cached_blocks

    def _shared_tail(self, request: Request, num_new_tokens: int) -> int | None:
        """Index in request.block_ids of the partly written block the next tokens go into, when
        another sequence holds it too; else None."""
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if num_new_tokens and offset and index < len(request.block_ids):
            if self.blocks[request.block_ids[index]].ref_count > 1:
                return index
        return None

    def _copy_on_write(self, request: Request, index: int) -> None:
        src = request.block_ids[index]
        dst = self.allocate(1)[0]
        self.blocks[src].ref_count -= 1  # still held by the sequence(s) it was shared with
        request.block_ids[index] = dst
        self.pending_copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks whose tokens are all known."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if num_full > request.num_cached_blocks:
            self.cache_blocks(request.block_ids[:num_full], request.block_hashes[:num_full],
                              request.all_token_ids, request.num_cached_blocks)
            request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (see release)."""
        self.release(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0

    # ---- prefix cache lookups ----------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int], block_hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, leaving at least one token to
        compute (the last token's logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits = []
        for i, block_hash in enumerate(block_hashes[:max_blocks]):
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            start = i * self.block_size
            if self.blocks[block_id].token_ids != tuple(token_ids[start:start + self.block_size]):
                break  # a hash collision: treat as a miss
            hits.append(block_id)
        return hits

    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by find_cached_prefix (reviving free ones)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    # ---- allocation --------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks off the free list (caller checks num_free_blocks first)."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self._free)} free")
        block_ids, evicted = [], []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = block.token_ids = None
            block.ref_count = 1
            block_ids.append(block_id)
        if evicted:
            self.pending_events.append(BlockRemoved(block_hashes=evicted))
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, last block first, so a sequence's tail is evicted
        before its (more shareable) prefix."""
        if self.pending_copies:  # a copy into a block released before its step ran is moot
            released = set(block_ids)
            self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in released]
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)  # nothing worth keeping: reuse first

    # ---- caching computed blocks -------------------------------------------------------------

    def cache_blocks(self, block_ids: list[int], block_hashes: list[int],
                     token_ids: list[int], start_block: int) -> None:
        """Register full, computed blocks block_ids[i] (i >= start_block) under block_hashes[i].

        Emits one BlockStored per contiguous run of newly cached blocks, with the hash of the
        block before the run as its parent (None for a sequence's first block)."""
        if not self.enable_prefix_caching:
            return
        run: list[int] = []
        run_parent = None
        for i in range(start_block, len(block_hashes)):
            block_hash = block_hashes[i]
            block = self.blocks[block_ids[i]]
            if block.block_hash is not None or block_hash in self.cached:
                # already cached (a prefix hit), or another sequence cached the same content
                self._emit_stored(run, run_parent)
                run = []
                continue
            block.block_hash = block_hash
            start = i * self.block_size
            block.token_ids = tuple(token_ids[start:start + self.block_size])
            self.cached[block_hash] = block.block_id
            if not run:
                run_parent = block_hashes[i - 1] if i > 0 else None
            run.append(block_hash)
        self._emit_stored(run, run_parent)

    def _emit_stored(self, run: list[int], parent_hash: int | None) -> None:
        if run:
            self.pending_events.append(BlockStored(
                block_hashes=run, parent_hash=parent_hash, num_tokens=len(run) * self.block_size))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no running sequence holds. True if all were dropped."""
        if any(b.ref_count > 0 and b.block_hash is not None for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self.cached.clear()
        self.pending_events.append(AllCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.pending_events = self.pending_events, []
        return events

    def cached_hashes(self) -> list[int]:
        return list(self.cached)
