"""The soak benchmark's verdict (kvmesh/bench/soak.py): growth after warm-up, lost requests, index
bound; its --mix parsing; and how its client load (kvmesh/bench/traffic.py) retries one request,
against HTTP and gRPC servers on 127.0.0.1 that answer as each test scripts."""

import contextlib
import json
import time

import pytest

from kvmesh.bench.soak import growth, judge, parse_mix


def _samples(values, key="Ingress[0]_rss_mb"):
    return [{"t": i, key: v, "router_index_blocks": 10, "kv_total_blocks": 100} for i, v in enumerate(values)]


def test_growth_compares_the_last_and_first_fifths_after_warm_up():
    values = [500] * 20 + [100] * 20 + [100] * 60 + [130] * 20  # warm-up spike is ignored
    assert growth(_samples(values), "Ingress[0]_rss_mb", 0.2) == 30
    assert growth(_samples([1, 2, 3]), "Ingress[0]_rss_mb", 0.2) is None


def test_judge_fails_on_a_lost_request_growth_or_an_index_beyond_the_pools():
    flat = _samples([100] * 50)
    assert judge(flat, {"lost": 0}, 50, 0.2)["ok"]
    assert not judge(flat, {"lost": 1}, 50, 0.2)["ok"]
    growing = _samples([100 + i * 3 for i in range(50)])
    verdict = judge(growing, {"lost": 0}, 50, 0.2)
    assert not verdict["ok"] and "memory grew" in verdict["problems"][0]
    big_index = [dict(s, router_index_blocks=1000) for s in flat]
    assert "router index" in judge(big_index, {"lost": 0}, 50, 0.2)["problems"][0]


def test_parse_mix():
    assert parse_mix("whole=1,abort=0.5") == {"whole": 1.0, "abort": 0.5}
    with pytest.raises(ValueError, match="kind=weight"):
        parse_mix("chat=1")


def test_traffic_reads_a_grpc_status_as_the_http_status_the_ingress_answers_for_it():
    """kvmesh.bench.traffic.GRPC_AS_HTTP is cluster/grpc_service.py's mapping read backwards, so a
    gRPC request is retried on what an HTTP one would be (429, 503), and fails on the rest."""
    from kvmesh.bench.traffic import GRPC_AS_HTTP, RETRY_STATUSES
    from kvmesh.cluster.grpc_service import _STATUS

    for http_status, code in _STATUS.items():
        assert GRPC_AS_HTTP[code.name] == http_status
    assert {name for name, status in GRPC_AS_HTTP.items() if status in RETRY_STATUSES} == {
        "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}


def test_a_grpc_request_needs_the_clusters_grpc_target():
    from kvmesh.bench.traffic import Traffic

    with pytest.raises(ValueError, match="grpc_target"):
        Traffic("http://127.0.0.1:9", "m").one(0, "grpc")


# ---- one request's attempts against loopback servers that answer as scripted -------------------

@contextlib.contextmanager
def _http_server(answers: list, pages: dict[str, bytes] | None = None):
    """An HTTP server on 127.0.0.1 answering each POST with the next of `answers` (status, body,
    headers, seconds to wait first; None: close the connection with no answer), the last one again
    once they run out, and each GET of a path in `pages` with that page."""
    import http.server
    import json
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            page = (pages or {}).get(self.path)
            if page is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            answer = answers[min(len(seen), len(answers) - 1)]
            if answer is None:
                seen.append(None)
                self.close_connection = True
                return
            status, body, headers, wait_s = answer
            seen.append(status)
            time.sleep(wait_s)
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                             **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a client past its deadline has gone

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


BUSY = (503, {"error": {"message": "busy", "code": "no_workers"}}, {"Retry-After": "0"}, 0)
DONE = (200, {"usage": {"completion_tokens": 16}}, {}, 0)


def test_an_http_request_is_retried_on_503_until_it_is_answered():
    from kvmesh.bench.traffic import Traffic

    with _http_server([BUSY, BUSY, DONE]) as (url, seen):
        out = Traffic(url, "m", max_attempts=5).one(0, "whole")
    assert (out.result, out.attempts, out.statuses, out.tokens) == ("ok", 3, [503, 503, 200], 16)
    assert seen == [503, 503, 200]


def test_an_http_request_stops_after_max_attempts_and_at_a_status_not_retried():
    from kvmesh.bench.traffic import Traffic

    with _http_server([BUSY]) as (url, seen):
        out = Traffic(url, "m", max_attempts=3).one(0, "whole")
    assert (out.result, out.attempts, out.statuses, out.detail) == ("failed", 3, [503] * 3, "HTTP 503")
    assert len(seen) == 3
    refused = (400, {"error": {"message": "no", "param": "prompt"}}, {}, 0)
    with _http_server([refused]) as (url, seen):
        out = Traffic(url, "m", max_attempts=3).one(0, "stream")
    assert (out.result, out.attempts, out.statuses) == ("failed", 1, [400])


def test_an_http_request_past_its_deadline_is_hung_whether_waiting_for_an_answer_or_a_retry():
    from kvmesh.bench.traffic import Traffic

    slow = (200, {"usage": {"completion_tokens": 16}}, {}, 1.5)
    with _http_server([slow]) as (url, _):
        out = Traffic(url, "m", timeout_s=0.3).one(0, "whole")
    assert (out.result, out.attempts, out.detail) == ("hung", 1, "no answer before the deadline")
    assert out.latency_s < 1.0
    later = (503, {"error": {"message": "busy"}}, {"Retry-After": "5"}, 0)
    with _http_server([later]) as (url, seen):
        out = Traffic(url, "m", timeout_s=0.5, max_retry_wait_s=5).one(0, "whole")
    # the retry's wait is cut at the deadline, which then has passed: no second attempt
    assert (out.result, out.attempts, seen) == ("hung", 1, [503])
    assert out.latency_s < 1.5


@contextlib.contextmanager
def _grpc_server(script):
    """A kvmesh.v1 Generation server on 127.0.0.1 whose Generate runs script(call_number, context)
    (a generator of GenerateResponse)."""
    from concurrent import futures

    import grpc

    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    calls = []

    class Servicer(pb_grpc.GenerationServicer):
        def Generate(self, request, context):
            calls.append(request.prompt)
            yield from script(len(calls), context)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_GenerationServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", calls
    finally:
        server.stop(0).wait(5)


def test_a_grpc_request_is_retried_while_no_token_came_and_cut_after_one():
    import grpc

    from kvmesh.bench.traffic import Traffic
    from kvmesh.proto import kvmesh_pb2 as pb

    def unavailable_then_whole(n, context):
        if n < 3:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no worker (retry-after: 0 s)")
        yield pb.GenerateResponse(token_ids=[1, 2])
        yield pb.GenerateResponse(token_ids=[3], finish_reason="length")

    with _grpc_server(unavailable_then_whole) as (target, calls):
        out = Traffic("http://127.0.0.1:9", "m", grpc_target=target, max_attempts=5).one(0, "grpc")
    assert (out.result, out.attempts, out.statuses, out.tokens) == ("ok", 3, [503, 503, 200], 3)
    assert len(calls) == 3

    def cut_after_a_token(n, context):
        yield pb.GenerateResponse(token_ids=[1])
        context.abort(grpc.StatusCode.UNAVAILABLE, "the worker died")

    with _grpc_server(cut_after_a_token) as (target, calls):
        out = Traffic("http://127.0.0.1:9", "m", grpc_target=target, max_attempts=5).one(0, "grpc")
    assert (out.result, out.attempts, out.statuses, out.tokens) == ("cut", 1, [503], 1)

    def refused(n, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: too long")
        yield

    with _grpc_server(refused) as (target, calls):
        out = Traffic("http://127.0.0.1:9", "m", grpc_target=target, max_attempts=5).one(0, "grpc")
    assert (out.result, out.attempts, out.statuses) == ("failed", 1, [400])
    assert out.detail == "gRPC INVALID_ARGUMENT: prompt: too long"


def test_a_grpc_request_that_keeps_failing_uses_its_attempts_and_says_so():
    import grpc

    from kvmesh.bench.traffic import Traffic

    def overloaded(n, context):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (retry-after: 0 s)")
        yield

    with _grpc_server(overloaded) as (target, calls):
        out = Traffic("http://127.0.0.1:9", "m", grpc_target=target, max_attempts=4).one(0, "grpc")
    assert (out.result, out.attempts, out.statuses) == ("failed", 4, [429] * 4)
    assert len(calls) == 4 and out.detail.startswith("gRPC RESOURCE_EXHAUSTED")


def test_kvmesh_bench_soak_exits_1_and_prints_fail_when_requests_are_lost(tmp_path):
    """RELIABILITY.md: `kvmesh bench soak` exits 1 if a request was lost. A loopback server that
    lists a model and serves /metrics but drops every generation request (it closes the
    connection without an answer) stands in for a broken cluster."""
    import subprocess
    import sys

    pages = {"/v1/models": b'{"data": [{"id": "m"}]}', "/metrics": b'kvmesh_router_index_blocks{model="m"} 0.0\n'}
    with _http_server([None], pages) as (url, _):
        out = tmp_path / "soak.json"
        proc = subprocess.run([sys.executable, "-m", "kvmesh.cli", "bench", "soak", "--url", url,
                               "--duration-s", "2", "--concurrency", "2", "--sample-every-s", "0.5",
                               "--timeout-s", "5", "--json", str(out)], capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAIL" in proc.stdout
    result = json.loads(out.read_text())
    assert not result["ok"] and result["lost"] == result["requests"] > 0, result
