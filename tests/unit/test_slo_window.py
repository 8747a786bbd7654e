"""The worker's end-to-end latency window: TTFT from the ingress's arrival stamp (so the wait
before the worker is inside), requests without a first token counted by their age, ITL per
finished request, samples older than the window dropped."""

from kvmesh.cluster.slo_window import LatencyWindow, p90


def test_p90_is_the_nearest_rank_and_zero_without_values():
    assert p90([]) == 0.0
    assert p90([float(i) for i in range(1, 11)]) == 10.0
    assert p90([float(i) for i in range(1, 21)]) == 19.0


def test_ttft_counts_from_the_arrival_stamp_not_from_when_the_worker_got_the_request():
    w = LatencyWindow(window_s=30)
    w.arrived("a", arrival=100.0)  # stamped at the ingress; reached the worker 4 s later
    w.first_token("a", now=104.5)
    assert w.ttft_p90(now=105.0) == 4.5


def test_a_request_without_a_first_token_counts_with_its_age():
    w = LatencyWindow(window_s=30)
    for i in range(9):
        w.arrived(f"served{i}", arrival=100.0)
        w.first_token(f"served{i}", now=100.2)
    w.arrived("stuck", arrival=100.0)
    assert w.ttft_p90(now=112.0) == 12.0  # 10 samples: the p90 is the stuck request's 12 s
    w.closed("stuck")  # aborted: no longer counted
    assert abs(w.ttft_p90(now=112.0) - 0.2) < 1e-9


def test_itl_is_the_mean_time_per_token_after_the_first():
    w = LatencyWindow(window_s=30)
    w.finished(first_token_time=10.0, num_tokens=11, now=12.0)
    w.finished(first_token_time=10.0, num_tokens=1, now=12.0)  # one token: no gap to measure
    assert w.itl_p90(now=12.0) == 0.2


def test_samples_older_than_the_window_are_dropped():
    w = LatencyWindow(window_s=5)
    w.arrived("a", arrival=0.0)
    w.first_token("a", now=3.0)
    w.finished(first_token_time=3.0, num_tokens=3, now=4.0)
    assert (w.ttft_p90(now=7.0), w.itl_p90(now=7.0)) == (3.0, 0.5)
    assert (w.ttft_p90(now=9.5), w.itl_p90(now=9.5)) == (0.0, 0.0)
