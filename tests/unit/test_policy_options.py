"""routing.policy_options: a policy's own options from the serving config (router.policies.
policy_options), checked by name and type when the config is read, and handed to the policy of every
router copy (the live cluster's copy: tests/integration/test_doc_claims_metrics_live.py)."""

import inspect

import pytest

from kvmesh.cluster.app import worker_options
from kvmesh.cluster.request_router import KVAwareRequestRouter
from kvmesh.router.cost import CostWeights
from kvmesh.router.policies import policy_options
from kvmesh.router.routing_state import RoutingState
from kvmesh.serve_config import parse_config


def test_options_reach_the_policy_of_a_routing_state():
    state = RoutingState("kv_events", 16, temperature=0.1,
                         policy_options={"weights": {"stay_margin": 4096, "prefill": 3.0},
                                         "pending_requests": 0})
    policy = state.router.policy
    assert policy.weights == CostWeights(stay_margin=4096, prefill=3.0)
    assert policy.pending is None and policy.temperature == 0.1
    approx = RoutingState("prefix_approx", 16, policy_options={"cache_threshold": 0.25, "balance_abs": 8})
    assert (approx.router.policy.cache_threshold, approx.router.policy.balance_abs) == (0.25, 8)


def test_the_cluster_s_request_router_is_given_them():
    cfg = parse_config({"routing": {"policy_options": {"weights": {"stay_margin": 4096}}}})
    kwargs = worker_options(cfg)["request_router_config"].request_router_kwargs
    assert kwargs["policy_options"] == {"weights": {"stay_margin": 4096}}
    # every kwarg Serve passes is a parameter of the router's initialize_state
    inspect.signature(KVAwareRequestRouter.initialize_state).bind(None, **kwargs)


@pytest.mark.parametrize("routing, message", [
    ({"policy_options": {"stay_margin": 1}},
     "routing.policy_options: stay_margin: policy 'kv_events' takes no option 'stay_margin' "
     "(its options: weights, temperature, pending_requests)"),
    ({"policy_options": {"weights": {"stay": 1}}}, "routing.policy_options: weights.stay: no such field"),
    ({"policy_options": {"weights": {"prefill": -1}}},
     "routing.policy_options: weights: CostWeights.prefill must be >= 0, got -1"),
    ({"policy_options": {"weights": 2}}, "routing.policy_options: weights: a mapping of CostWeights's fields"),
    ({"policy_options": {"pending_requests": 1.5}},
     "routing.policy_options: pending_requests: a whole number like its default 4096, got 1.5"),
    ({"policy_options": {"pending_requests": True}}, "pending_requests: a whole number"),
    ({"policy_options": {"temperature": 0.2}},
     "routing.policy_options: temperature: set routing.temperature instead"),
    ({"policy": "prefix_approx", "policy_options": {"max_blocks_per_worker": 0}},
     "routing.policy_options: max_blocks_per_worker must be >= 1, got 0"),
    ({"policy": "prefix_approx", "policy_options": {"cache_threshold": "high"}},
     "cache_threshold: a number like its default 0.5, got 'high'"),
    ({"policy": "round_robin", "policy_options": {"virtual_nodes": 8}},
     "policy 'round_robin' takes no option 'virtual_nodes' (its options: none)"),
    ({"policy": "round_robin", "temperature": 0.5},
     "routing.temperature: policy 'round_robin' takes no temperature (kv_events does)"),
])
def test_a_bad_option_is_refused_by_name(routing, message):
    with pytest.raises(ValueError) as e:
        parse_config({"routing": routing})
    assert message in str(e.value)


def test_no_options_are_the_policy_s_defaults():
    assert policy_options("kv_events", None) == {}
    assert RoutingState("kv_events", 16).router.policy.weights == CostWeights()
    assert parse_config({"routing": {"policy": "session", "policy_options": {"virtual_nodes": 8}}})


def test_the_simulator_takes_them_per_policy_for_one_router_and_for_its_copies():
    from kvmesh.router.sim.cluster import SimConfig
    from kvmesh.router.sim.run import run

    options = {"kv_events": {"weights": {"stay_margin": 4096}, "pending_requests": 100}}
    for copies in (0, 2):
        config = SimConfig(num_workers=4, kv_blocks=2000, seed=0, router_copies=copies,
                           policy_options=options)
        report = run("prefix_repetition", ["kv_events", "round_robin"], config, num_requests=100,
                     load=0.5, keep_results=True)
        policy = report["results"]["kv_events"].router.policy
        assert (policy.weights.stay_margin, policy.pending.max_requests) == (4096, 100)
        assert report["config"]["policy_options"] == options


def test_kvmesh_sim_policy_opt_builds_each_policy_s_options_and_names_a_bad_one(capsys):
    from kvmesh.cli import main
    from kvmesh.commands.sim import parse_policy_options

    assert parse_policy_options(["kv_events.weights.stay_margin=4096", "kv_events.weights.prefill=3.0",
                                 "prefix_approx.balance_abs=8"], ["kv_events", "prefix_approx"]) == {
        "kv_events": {"weights": {"stay_margin": 4096, "prefill": 3.0}},
        "prefix_approx": {"balance_abs": 8}}
    for pair, message in [("kv_events.weights.nope=1", "--policy-opt kv_events.weights.nope: no such field"),
                          ("kv_events.pending_requests=0.5", "pending_requests: a whole number"),
                          ("session.virtual_nodes=8", "session is not among the policies run"),
                          ("kv_events=1", "--policy-opt wants POLICY.KEY=VALUE")]:
        assert main(["sim", "--workers", "2", "--requests", "10", "--no-progress",
                     "--policy-opt", pair]) == 2
        assert message in capsys.readouterr().err
