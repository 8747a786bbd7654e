"""The router's long-lived hash sequences are arrays whose hashes the garbage collector does not visit
(an array's only referent is its type): a young collection would otherwise visit every hash of the
pending records and the index's runs (docs/ROUTING.md "Inside the simulator")."""

import gc
from array import array

import numpy as np

from kvmesh.hashing import block_hashes, hash_array
from kvmesh.protocol import BlockStored, KVEventBatch
from kvmesh.router.policies.base import RouteRequest
from kvmesh.router.router import Router

B = 16


def test_hash_array_keeps_an_array_and_converts_lists_and_uint64_arrays():
    hashes = block_hashes(list(range(8 * B)), B)
    packed = hash_array(hashes)
    assert isinstance(packed, array) and packed.typecode == "Q" and list(packed) == hashes
    assert hash_array(packed) is packed
    assert list(hash_array(np.array(hashes, dtype=np.uint64))) == hashes
    assert gc.get_referents(packed) == [array]  # the hashes are not references


def test_index_runs_and_pending_records_hold_hash_arrays():
    router = Router(block_size=B, seed=0)
    for w in ("a", "b"):
        router.add_worker(w)
    chain = block_hashes(list(range(40 * B)), B)
    router.on_events(KVEventBatch("a", 0, 0, [BlockStored(chain[:20], None, 20 * B)]))
    router.route(chain, 40 * B, limit=1)  # a list: copied once into an array
    other = block_hashes(list(range(5000, 5000 + 10 * B)), B)
    router.route_request(RouteRequest(hash_array(other), 10 * B), limit=1)
    runs = {id(run): run for run in router.index._blocks.values()}.values()
    assert runs and all(isinstance(run.hashes, array) and run.hashes.typecode == "Q" for run in runs)
    records = list(router.policy.pending._records.values())
    assert len(records) == 2
    assert all(isinstance(hashes, array) and hashes.typecode == "Q" for _, hashes, _ in records)
