"""Prefixes in flight: blocks this router has just sent to a worker, which the worker's KV events do
not show yet.

A worker announces a block only once it has computed it (a prompt of 8k tokens takes a few engine
steps), so a request that shares a prefix with one routed a moment ago sees no holder in the index
and, routed by load, computes the prefix a second time elsewhere and leaves two copies. The kv_events
policy records each request it routes (its block hashes past those the index shows on the chosen
worker) and credits that worker with the blocks a later request shares with it, until the index
catches up (its own overlap then reaches past the recorded start, and the record is not consulted).

A request that has ended on its worker (the router that sent it heard its last output:
`Router.finish_routed`) leaves its record marked *computed*: the worker holds those blocks, which its
events may not have shown this router yet, so a request that follows at once (a conversation's next
turn, sent when the answer arrives) is credited as if the index showed them.

One record per routed request, keyed by the first block the worker had to compute, holding a reference
to the request's hashes (no copy). The Router hands them over as an array('Q'), whose hashes the
garbage collector does not visit: 4,096 records of lists of ~500 hashes were 2 million references
for a young collection to visit (docs/ROUTING.md "Inside the simulator"). Because the hashes are
chained, two chains that agree on block k agree on every block before it, so the shared length is
found by bisection (O(log blocks)). Bounded to the `max_requests` most recent records: a record is
needed for one prefill's duration. Not thread-safe: the Router holds the lock.
"""

from collections import OrderedDict
from collections.abc import Sequence


class PendingPrefixes:
    def __init__(self, max_requests: int = 4096):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        # first block to compute -> (worker, the routed request's block hashes (an array('Q')),
        # computed: the request has ended there)
        self._records: OrderedDict[int, tuple[str, Sequence[int], bool]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, block_hashes: Sequence[int], start: int, worker_id: str) -> None:
        """`block_hashes[start:]` were just sent to `worker_id` (the index shows it holds the rest).
        The sequence is kept by reference: it must not change afterwards."""
        if start >= len(block_hashes):
            return
        key = block_hashes[start]
        records = self._records
        records[key] = (worker_id, block_hashes, False)
        records.move_to_end(key)
        if len(records) > self.max_requests:
            records.popitem(last=False)

    def continuation(self, block_hashes: Sequence[int], start: int) -> tuple[str | None, int, bool]:
        """(worker, n, computed): `block_hashes[start:start + n]` were sent to that worker by the latest
        record that starts at `block_hashes[start]`, whose request has ended there if `computed`;
        (None, 0, False) when no record starts there."""
        if start >= len(block_hashes):
            return None, 0, False
        found = self._records.get(block_hashes[start])
        if found is None:
            return None, 0, False
        worker, sent, computed = found
        # Chained hashes: equal at block k means equal at every block before it. Bisect for the
        # last equal block (block `start` is equal: it is the key).
        lo, hi = start, min(len(block_hashes), len(sent)) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_hashes[mid] == sent[mid]:
                lo = mid
            else:
                hi = mid - 1
        return worker, lo + 1 - start, computed

    def mark_computed(self, block_hashes: Sequence[int], worker_id: str) -> bool:
        """The request routed with `block_hashes` (the same object `record` was given) has ended on
        `worker_id`: its record, if it is still the latest from its start, becomes computed. O(the
        request's blocks) dict lookups, once per request. True if a record was marked."""
        records = self._records
        for key in block_hashes:
            found = records.get(key)
            if found is not None and found[1] is block_hashes and found[0] == worker_id:
                records[key] = (worker_id, block_hashes, True)
                return True
        return False

    def forget_worker(self, worker_id: str) -> None:
        """Drop a worker's records (it left the cluster): O(records), once per removal."""
        for key in [k for k, (w, _, _) in self._records.items() if w == worker_id]:
            del self._records[key]
