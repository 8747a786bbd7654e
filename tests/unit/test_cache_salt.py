"""vLLM's cache_salt in the engine: a request's blocks are hashed under its salt as well as the
model's (kvmesh.hashing.tenant_salt), so a prompt's cached blocks are found only by requests of the
same salt, whether the engine hashes the prompt itself or is handed the ingress's hashes. The
endpoint, routed through the cluster: tests/integration/api_field_walk.py check_cache_salt."""

from kvmesh import LLM, SamplingParams
from kvmesh.hashing import block_hashes, tenant_salt
from kvmesh.protocol import EngineRequest


def cached_tokens(engine, request_id: str, ids: list[int], salt: str | None, hashed: bool = False) -> int:
    """The prefix-cache hit of one request (run to its end); `hashed`: the caller hashes the
    prompt, as the ingress does."""
    extra = {}
    if hashed:
        extra = {"block_hashes": block_hashes(ids, engine.block_size, tenant_salt(engine.hash_salt, salt)),
                 "hash_block_size": engine.block_size}
    engine.add_request(EngineRequest(request_id, ids, SamplingParams(max_tokens=1, temperature=0),
                                     cache_salt=salt, **extra))
    found = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == request_id and delta.finished:
                found = delta.num_cached_tokens
    return found


def test_a_prompt_s_cached_blocks_are_found_only_under_the_same_salt():
    with LLM("random:tiny-llama", device="cpu", block_size=16) as llm:
        engine = llm.engine
        ids = llm.encode("a prompt that fills several blocks of sixteen tokens each, " * 3)
        assert cached_tokens(engine, "a1", ids, "tenant-a") == 0
        assert cached_tokens(engine, "a2", ids, "tenant-a") >= 16  # the same salt: a hit
        assert cached_tokens(engine, "b1", ids, "tenant-b") == 0  # another tenant's: a miss
        assert cached_tokens(engine, "n1", ids, None) == 0  # no salt: a miss too
        # the ingress's hashes (salted the same way) find the engine's own
        assert cached_tokens(engine, "a3", ids, "tenant-a", hashed=True) >= 16
        assert cached_tokens(engine, "b2", ids, "tenant-b", hashed=True) >= 16


def test_the_salt_changes_every_hash_and_none_or_empty_is_the_model_s_alone():
    ids = list(range(64))
    model = b"model"
    assert tenant_salt(model, None) == tenant_salt(model, "") == model
    plain, a, b = (block_hashes(ids, 16, tenant_salt(model, s)) for s in (None, "a", "b"))
    assert len(plain) == 4 and not set(plain) & set(a) and not set(a) & set(b)
