"""The routing process's collector settings (router/gc_tuning.py)."""

import gc

from kvmesh.router.gc_tuning import ROUTING_GC_THRESHOLDS, tune_gc_for_routing


def test_tuning_freezes_the_heap_and_sets_the_thresholds():
    before_threshold, before_frozen = gc.get_threshold(), gc.get_freeze_count()
    held = [[i] for i in range(10_000)]  # what an index holds (lists: always tracked by the GC)
    try:
        assert tune_gc_for_routing() == before_threshold
        assert gc.get_threshold() == ROUTING_GC_THRESHOLDS
        assert gc.get_freeze_count() >= before_frozen + len(held)  # out of every collection
    finally:
        gc.unfreeze()
        gc.set_threshold(*before_threshold)


def test_the_decisions_benchmark_runs_with_the_routing_settings_unless_asked_not_to():
    from kvmesh.router.sim.decisions import main
    import contextlib
    import io
    import json

    before = gc.get_threshold()
    try:
        for flag, expected in (([], list(ROUTING_GC_THRESHOLDS)), (["--default-gc"], list(before))):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                main(["--workers", "4", "--workloads", "tenants", "--seeds", "1-1", "--requests", "50",
                      "--json", "--in-process"] + flag)
            assert json.loads(out.getvalue())["gc_thresholds"] == expected
            gc.unfreeze()
            gc.set_threshold(*before)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_kvmesh_sim_runs_with_the_routing_settings():
    """docs/ROUTING.md: `kvmesh sim` tunes its collector as a routing process does (thresholds
    100,000 / 50 / 100, the heap frozen)."""
    from kvmesh.cli import main

    before = gc.get_threshold()
    try:
        assert main(["sim", "--workers", "2", "--requests", "20", "--no-progress",
                     "--policy", "round_robin", "--json"]) == 0
        assert gc.get_threshold() == ROUTING_GC_THRESHOLDS == (100_000, 50, 100)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
