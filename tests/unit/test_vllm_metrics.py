"""The ingress's metrics under vLLM's names (docs/METRICS.md): a finished request observed once
feeds each vllm: metric with the `model_name` label, worker gauges carry `engine`, an abort
is counted with finished_reason "abort", and a stream that failed is no success."""

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cluster.auth import ApiKeys
from kvmesh.cluster.engine_loop import EngineUnavailable
from kvmesh.cluster.frontend import Frontend
from kvmesh.cluster.limits import RequestLimits
from kvmesh.cluster.messages import ModelInfo
from kvmesh.cluster.metrics import FINISHED_REASONS, IngressMetrics, TokenGaps
from kvmesh.cluster.pipeline import GenerationRequest, Prompt, RequestPipeline
from kvmesh.protocol import TokenDelta, WorkerLoad
from kvmesh.sampling_params import SamplingParams
from kvmesh.serve_config import parse_config
from handle_support import Handle

MODEL = "tiny"


def samples(metrics: IngressMetrics, loads=None, stats=None) -> dict:
    text = metrics.render(loads or {}, stats or {}).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def values(found: dict, names, **labels) -> dict:
    """{name: value} of the metrics `names` with these labels (a missing one is a KeyError)."""
    return {name: value(found, name, **labels) for name in names}


def test_a_finished_request_feeds_the_vllm_request_metrics():
    m = IngressMetrics()
    m.init_model(MODEL)
    last = TokenDelta("r", [5], "", finish_reason="length", num_prompt_tokens=10,
                      num_cached_tokens=4, arrival_time=100.0, scheduled_time=100.5,
                      first_token_time=101.0)
    m.observe_engine_times(MODEL, last, first_token=200.25, end=201.25, output_tokens=5,
                           prompt_tokens=10, cached_tokens=4, arrival=200.0,
                           token_gaps=[0.125, 0.125, 0.25, 0.5])
    found = samples(m)
    assert value(found, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 1
    assert value(found, "vllm:request_success_total", model_name=MODEL, finished_reason="stop") == 0
    expected = {"vllm:prompt_tokens_total": 10, "vllm:generation_tokens_total": 5,
                "vllm:prefix_cache_queries_total": 10, "vllm:prefix_cache_hits_total": 4,
                "vllm:time_to_first_token_seconds_sum": 0.25, "vllm:e2e_request_latency_seconds_sum": 1.25,
                "vllm:inter_token_latency_seconds_count": 4,  # 4 gaps
                "vllm:inter_token_latency_seconds_sum": 1.0,
                "vllm:request_queue_time_seconds_sum": 0.5, "vllm:request_prefill_time_seconds_sum": 0.5,
                "vllm:request_decode_time_seconds_sum": 1.0, "vllm:request_inference_time_seconds_sum": 1.5,
                "vllm:request_generation_tokens_count": 1}
    assert values(found, expected, model_name=MODEL) == expected
    # each gap in its own bucket, not the request's mean (0.25) four times
    assert value(found, "vllm:inter_token_latency_seconds_bucket", model_name=MODEL, le="0.15") == 2
    assert value(found, "vllm:inter_token_latency_seconds_bucket", model_name=MODEL, le="0.3") == 3


def test_the_kvmesh_request_histograms_observe_ttft_tpot_e2e_in_the_documented_buckets():
    """docs/METRICS.md: TTFT = first token - arrival, TPOT = (end - first) / (tokens - 1), not
    observed for one-token requests, E2E = end - arrival; buckets 5 ms-60 s and 1 ms-2.5 s."""
    m = IngressMetrics()
    m.init_model(MODEL)
    m.observe_request(MODEL, arrival=10.0, first_token=10.5, end=12.5, prompt_tokens=7, output_tokens=5,
                      cached_tokens=0)
    m.observe_request(MODEL, arrival=20.0, first_token=20.25, end=20.25, prompt_tokens=7, output_tokens=1,
                      cached_tokens=0)
    found = samples(m)
    expected = {"kvmesh_request_ttft_seconds_sum": 0.75, "kvmesh_request_ttft_seconds_count": 2,
                "kvmesh_request_tpot_seconds_sum": 0.5, "kvmesh_request_tpot_seconds_count": 1,
                "kvmesh_request_e2e_seconds_sum": 2.75, "kvmesh_request_e2e_seconds_count": 2}
    assert values(found, expected, model=MODEL) == expected
    for name, low, high in (("kvmesh_request_ttft_seconds", "0.005", "60.0"),
                            ("kvmesh_request_e2e_seconds", "0.005", "60.0"),
                            ("kvmesh_request_tpot_seconds", "0.001", "2.5")):
        bounds = [labels["le"] for (sample, labels_key), _ in found.items() if sample == name + "_bucket"
                  for labels in [dict(labels_key)] if labels.get("model") == MODEL]
        finite = sorted((b for b in bounds if b != "+Inf"), key=float)
        assert (finite[0], finite[-1]) == (low, high), (name, finite)


def test_a_stream_whose_worker_died_after_tokens_is_not_a_success():
    """It ends with finish_reason "error": counted as status 503, under no finished_reason of
    vllm:request_success_total, and its tokens and latencies in none of the success metrics."""
    handle = Handle([TokenDelta("r", [5], "x", num_prompt_tokens=3),
                     TokenDelta("r", [6], "y", num_prompt_tokens=3),
                     EngineUnavailable("w1", "engine process died")])
    config = parse_config({"model": "random:tiny-llama"})
    frontend = Frontend(config, worker_handle=handle)
    frontend._info = ModelInfo("tiny-llama", max_model_len=64, block_size=16, hash_salt=b"")
    pipeline = RequestPipeline(frontend, RequestLimits(config.limits), ApiKeys(()))

    async def stream_it():
        admitted = await pipeline.admit(GenerationRequest(
            Prompt("prompt_token_ids", token_ids=[1, 2, 3]),
            lambda budget: SamplingParams(max_tokens=16)))
        async with await pipeline.stream(admitted) as stream:
            return [delta async for delta in stream]

    out = asyncio.run(stream_it())
    assert [d.token_ids for d in out] == [[5], [6], []] and out[-1].finish_reason == "error"
    found = samples(frontend.metrics)
    model = frontend.model_name
    assert value(found, "kvmesh_requests_total", model=model, status="503") == 1
    assert value(found, "kvmesh_requests_total", model=model, status="200") == 0
    assert {reason: value(found, "vllm:request_success_total", model_name=model,
                          finished_reason=reason) for reason in FINISHED_REASONS} == {
        "stop": 0, "length": 0, "abort": 0}
    not_observed = {"vllm:prompt_tokens_total": 0, "vllm:generation_tokens_total": 0,
                    "vllm:request_generation_tokens_count": 0,
                    "vllm:e2e_request_latency_seconds_count": 0}
    assert values(found, not_observed, model_name=model) == not_observed
    assert values(found, ["kvmesh_prompt_tokens_total", "kvmesh_generation_tokens_total",
                          "kvmesh_request_e2e_seconds_count"], model=model) == {
        "kvmesh_prompt_tokens_total": 0, "kvmesh_generation_tokens_total": 0,
        "kvmesh_request_e2e_seconds_count": 0}


def test_an_abort_is_counted_under_both_names():
    m = IngressMetrics()
    m.init_model(MODEL)
    m.observe_abort(MODEL, prompt_tokens=3, output_tokens=1)
    found = samples(m)
    assert value(found, "vllm:request_success_total", model_name=MODEL, finished_reason="abort") == 1
    assert value(found, "kvmesh_requests_aborted_total", model=MODEL) == 1


def test_worker_gauges_have_vllm_names_per_engine():
    m = IngressMetrics()
    m.init_model(MODEL)
    loads = {"w1": WorkerLoad("w1", running=2, waiting=3, kv_free_blocks=25, kv_total_blocks=100)}
    found = samples(m, loads, {"w1": {"preemptions": 7}})
    expected = {"vllm:num_requests_running": 2, "vllm:num_requests_waiting": 3,
                "vllm:kv_cache_usage_perc": 0.75, "vllm:num_preemptions_total": 7}
    assert values(found, expected, model_name=MODEL, engine="w1") == expected


def test_token_gaps_are_each_gap_per_sequence_also_when_deltas_were_merged():
    gaps = TokenGaps()
    first = TokenDelta("r", [1], "", token_times=[10.0])
    merged = TokenDelta("r", [2], "", token_times=[10.5]).followed_by(
        TokenDelta("r", [3], "", token_times=[12.0]))  # a reader that fell behind gets one delta
    other = TokenDelta("r", [7, 8], "", token_times=[10.25, 10.75], index=1)  # n > 1
    for delta in (first, other, merged):
        gaps.add(delta)
    assert gaps.gaps == [0.5, 0.5, 1.5]


def test_an_abort_observes_the_gaps_of_the_tokens_it_made():
    m = IngressMetrics()
    m.init_model(MODEL)
    m.observe_abort(MODEL, prompt_tokens=3, output_tokens=3, token_gaps=[0.01, 0.02])
    found = samples(m)
    assert value(found, "vllm:inter_token_latency_seconds_count", model_name=MODEL) == 2
