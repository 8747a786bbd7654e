"""The one block-hash function, shared by the worker's block manager and the router.

h[0] = H(root(salt) || tokens[0:B]), h[i] = H(h[i-1] || tokens[i*B:(i+1)*B]), tokens packed as
little-endian int32, H = xxh3_64. Stable across processes, machines and Python versions. Only full
blocks are hashed: a partial block can still change, so it is never shared.
"""

from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

_INT32_LE = np.dtype("<i4")


def root_hash(salt: bytes = b"") -> int:
    """The chain's seed; the salt separates models (and adapters or tenants that must not share)."""
    return xxhash.xxh3_64_intdigest(b"kvmesh/v1\x00" + salt)


def tenant_salt(model_salt: bytes, cache_salt: str | None) -> bytes:
    """The salt of a request's chain: the model's, and vLLM's per-request `cache_salt` when given,
    so requests of different salts never share a cached block (nor learn of one by its speed)."""
    if not cache_salt:
        return model_salt
    return model_salt + b"\x00cache_salt\x00" + cache_salt.encode("utf-8", "surrogatepass")


def hash_block(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (or root_hash for the first)."""
    payload = parent_hash.to_bytes(8, "little") + np.asarray(block_token_ids, _INT32_LE).tobytes()
    return xxhash.xxh3_64_intdigest(payload)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"",
                 parent_hash: int | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids`.

    `parent_hash` continues a chain (the hash of the block before token_ids[0]); by default the chain
    starts at root_hash(salt).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    packed = np.asarray(token_ids[: num_full * block_size], _INT32_LE).tobytes()
    stride = 4 * block_size
    h = root_hash(salt) if parent_hash is None else parent_hash
    hashes = []
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(packed), stride):
        h = digest(h.to_bytes(8, "little") + packed[start:start + stride])
        hashes.append(h)
    return hashes


def model_salt(model_name: str) -> bytes:
    """The salt for a model's blocks: worker and router derive it from the same model name."""
    return model_name.encode("utf-8")


def hash_array(hashes: Sequence[int] | array | np.ndarray) -> array:
    """`hashes` as an array('Q') (unsigned 64-bit, as xxh3_64 gives them): the form a router keeps
    them in. Python's garbage collector does not visit the hashes of an array (its one referent is
    its type), so a router's long-lived hash sequences (the index's runs, the records of prefixes in
    flight) cost a collection one visit each, where a list of 500 hashes costs it 500
    (docs/ROUTING.md "Inside the simulator"). An array('Q') is returned as it is (no copy: it must
    not change afterwards); a list costs ~40 ns a hash, so whoever produces the hashes should
    produce the array (a numpy uint64 array's `tobytes()` gives it in ~1 us for 500)."""
    if isinstance(hashes, array) and hashes.typecode == "Q":
        return hashes
    if isinstance(hashes, np.ndarray):
        return array("Q", hashes.astype(np.uint64, copy=False).tobytes())
    return array("Q", hashes)
