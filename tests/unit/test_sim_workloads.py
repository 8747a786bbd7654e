"""Workload generators: seeded, hashed with kvmesh.hashing, shaped as documented."""

import numpy as np
import pytest

from kvmesh.hashing import block_hashes
from kvmesh.router.sim.workloads import assign_arrivals, make_workload

B = 16


def test_hashes_are_kvmesh_hashing_of_prompt_plus_output():
    for name in ("tenants", "multiturn", "prefix_repetition", "random"):
        for r in make_workload(name, 30, seed=3).requests[:10]:
            tokens = r.tokens[:r.prompt_len + r.output_len].tolist()
            assert r.hashes.tolist() == block_hashes(tokens, B), name
            assert list(r.prompt_hashes(B)) == block_hashes(r.prompt_token_ids, B), name


def test_same_seed_same_trace_other_seed_other_trace():
    a, b, c = (make_workload("tenants", 20, seed=s) for s in (1, 1, 2))
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]


def test_tenants_share_their_system_prompt():
    wl = make_workload("tenants", 200, num_tenants=4, system_tokens=64)
    by_tenant = {}
    for r in wl.requests:
        by_tenant.setdefault(r.group, set()).add(tuple(r.prompt_hashes(B)[:4]))
    assert len(by_tenant) == 4 and all(len(v) == 1 for v in by_tenant.values())


def test_multiturn_next_prompt_extends_previous_prompt_and_answer():
    wl = make_workload("multiturn", 40, turns=(3, 3))
    by_id = {r.request_id: r for r in wl.requests}
    followups = [r for r in wl.requests if r.after is not None]
    assert followups
    for r in followups:
        prev = by_id[r.after]
        prefix = prev.tokens[:prev.prompt_len + prev.output_len].tolist()
        assert r.prompt_token_ids[:len(prefix)] == prefix
        assert r.prompt_len > len(prefix) and r.session_key == prev.session_key


def test_prefix_repetition_uses_p_prefixes_and_fixed_lengths():
    wl = make_workload("prefix_repetition", 100, num_prefixes=5, prefix_tokens=64, suffix_tokens=32,
                       output_tokens=8)
    assert len({tuple(r.prompt_hashes(B)[:4]) for r in wl.requests}) == 5
    assert {(r.prompt_len, r.output_len) for r in wl.requests} == {(96, 8)}


def test_random_prompts_share_no_block():
    wl = make_workload("random", 50)
    hashes = [h for r in wl.requests for h in r.hashes.tolist()]
    assert len(hashes) == len(set(hashes))


def test_poisson_arrivals_scale_with_rate():
    wl = make_workload("random", 2000, seed=0)
    assign_arrivals(wl, 100.0)
    gaps = np.diff([r.arrival for r in wl.requests])
    assert gaps.mean() == pytest.approx(0.01, rel=0.1) and (gaps > 0).all()


def test_follow_up_turns_get_their_arrival_at_run_time():
    wl = make_workload("multiturn", 30)
    assign_arrivals(wl, 10.0)
    assert all(np.isnan(r.arrival) == (r.after is not None) for r in wl.requests)


def test_bad_names_and_sizes_are_errors():
    with pytest.raises(ValueError, match="unknown workload 'x'"):
        make_workload("x", 10)
    with pytest.raises(ValueError, match="requests must be >= 1"):
        make_workload("random", 0)


def test_open_loop_follow_ups_arrive_a_think_time_after_the_previous_turn():
    wl = make_workload("multiturn", 30)
    assign_arrivals(wl, 10.0, followups="open")
    by_id = {r.request_id: r for r in wl.requests}
    for r in wl.requests:
        if r.after is not None:
            assert r.arrival == by_id[r.after].arrival + r.think_time_s
    with pytest.raises(ValueError, match="followups must be"):
        assign_arrivals(wl, 10.0, followups="sometimes")
