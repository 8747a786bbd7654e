"""The garbage collector of a process that routes.

A router's index holds millions of small objects (hashes, runs, holder sets) that live for the
whole run. With CPython's default thresholds (700, 10, 10) a young collection runs every few
hundred allocations, a middle one every few thousand, and a full one walks the whole index: inside
a routing decision these are the decision's tail (docs/ROUTING.md "Inside the simulator": the
1,024-worker p99 halved with this setting). So a routing process freezes what it holds at start
(`gc.freeze`: moved out of every collection) and collects young objects every 100,000 allocations,
with full collections rare. The router creates few reference cycles (its structures are trees of
dicts, lists and tuples), so garbage is still freed at once by reference counting; what waits
longer is cyclic garbage only.
"""

from __future__ import annotations

import gc

# (young, middle, old): a young collection after this many net allocations; a middle one after 50
# young ones; a full one after 100 middle ones (and then only when the long-lived objects grew by a
# quarter, CPython's own rule).
ROUTING_GC_THRESHOLDS = (100_000, 50, 100)


def tune_gc_for_routing() -> tuple[int, int, int]:
    """Apply the routing process's collector settings; returns the thresholds before."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*ROUTING_GC_THRESHOLDS)
    return before


def freeze_setup() -> bool:
    """In a process tuned for routing (tune_gc_for_routing), move what exists now out of every
    collection, as tune_gc_for_routing does at start; True if it did. For the simulator: its trace
    and simulated workers (their caches hold millions of references) are built after the process
    starts and are no part of a router process, whose young collections they would otherwise
    lengthen (docs/ROUTING.md "Inside the simulator")."""
    if gc.get_threshold() != ROUTING_GC_THRESHOLDS:
        return False
    gc.collect()
    gc.freeze()
    return True
