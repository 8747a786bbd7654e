"""Two ingress replicas (two router copies) in front of two CPU workers with small request limits:
every copy routes a shared prefix to the worker holding it, and an overload is answered with 429
and Retry-After instead of waiting without bound. The workers stream 4 tokens per chunk. Both
ingress replicas also serve the API on one shared port of their own (server.direct_http_port), and
share one store of /v1/responses responses (server.responses_store)."""

import concurrent.futures as cf
import json
import time
import urllib.error
import urllib.request

import pytest

from kvmesh.cluster.local import free_port
from cluster_support import MODEL, config_cluster, cpu_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    direct_port = free_port()
    config = cpu_config(2, replicas={"max_ongoing_requests": 2, "max_queued_requests": 1},
                        routing={"policy": "kv_events", "ingress_replicas": 2},
                        server={"stream_interval": 4, "direct_http_port": direct_port,
                                "responses_store": 100})
    with config_cluster(tmp_path_factory, config) as c:
        c.direct_url = f"http://127.0.0.1:{direct_port}"
        yield c


def post(cluster, body, timeout=120, base=None):
    req = urllib.request.Request((base or cluster.http_url) + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp), resp.headers
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw), e.headers
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}, e.headers


def test_stream_interval_sends_the_first_token_at_once_then_chunks_of_four(cluster):
    body = {"model": MODEL, "prompt": "Count the waves.", "max_tokens": 18, "temperature": 0,
            "ignore_eos": True}
    status, whole, _ = post(cluster, body)
    assert status == 200
    req = urllib.request.Request(cluster.http_url + "/v1/completions",
                                 json.dumps({**body, "stream": True, "logprobs": 0}).encode(),
                                 {"Content-Type": "application/json"})
    sizes, text = [], ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                sizes.append(len(choice["logprobs"]["tokens"]) if choice.get("logprobs") else 0)
    sizes = [n for n in sizes if n]
    assert text == whole["choices"][0]["text"]
    # the first chunk is not held back (it has more than one token only when the worker fell
    # behind the engine); then chunks of at least 4, and the last is what is left
    assert sum(sizes) == 18 and len(sizes) <= 1 + 17 // 4 + 1, sizes
    assert all(n >= 4 for n in sizes[1:-1]), sizes


def test_every_router_copy_sends_a_cached_prefix_to_its_worker(cluster):
    prefix = "Shared instructions for every ingress replica to see. " * 8
    status, first, _ = post(cluster, {"model": MODEL, "prompt": prefix + "first", "max_tokens": 2})
    assert status == 200
    # The copy that routed it knows at once; the other learns from the worker's KV events, which
    # race the answer's way back and the next request's way in (CI I: one of 9 lost that race).
    # Routing on the events once they arrived is what this checks.
    time.sleep(1.0)
    cached = []
    for i in range(8):  # Serve's proxy spreads these over both ingress replicas
        status, body, _ = post(cluster, {"model": MODEL, "prompt": prefix + f"again {i}",
                                         "max_tokens": 2})
        assert status == 200
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert min(cached) >= 16 * (len(prefix) // 16 - 1), cached


def test_an_overload_gets_429_with_retry_after_and_the_rest_are_served(cluster):
    def one(i):
        return post(cluster, {"model": MODEL, "prompt": f"overload {i}", "max_tokens": 300,
                              "ignore_eos": True, "temperature": 0})

    with cf.ThreadPoolExecutor(24) as ex:
        results = list(ex.map(one, range(24)))
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) >= 4 and statuses.count(429) >= 1, statuses
    for status, body, headers in results:
        if status == 429:
            assert "error" in body, body
            assert body["error"]["code"] == "overloaded"
            assert int(headers["Retry-After"]) >= 1
    # and it keeps serving
    assert post(cluster, {"model": MODEL, "prompt": "after the storm", "max_tokens": 2})[0] == 200


def test_the_direct_port_serves_the_same_api_from_both_ingress_replicas(cluster):
    import openai
    import psutil

    port = int(cluster.direct_url.rsplit(":", 1)[1])
    ingresses = [p for p in psutil.Process(cluster.proc.pid).children(recursive=True)
                 if ":Ingress" in " ".join(p.cmdline())]
    listening = [p for p in ingresses if any(
        c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp"))]
    assert len(ingresses) == 2 and len(listening) == 2  # one shared port (SO_REUSEPORT)

    body = {"model": MODEL, "prompt": "Straight to the ingress.", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    status, via_proxy, _ = post(cluster, body)
    assert status == 200
    client = openai.OpenAI(base_url=cluster.direct_url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=12, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == via_proxy["choices"][0]["text"]
    status, error, _ = post(cluster, {**body, "temperature": -1}, base=cluster.direct_url)
    assert status == 400 and error["error"]["param"] == "temperature"


def running_and_tokens_out(cluster) -> tuple[int, int]:
    """The workers' running requests and output tokens so far (/v1/kvmesh/workers)."""
    with urllib.request.urlopen(cluster.http_url + "/v1/kvmesh/workers", timeout=10) as r:
        rows = json.load(r)["workers"]
    return sum(w["running"] for w in rows), sum(w["tokens_out"] for w in rows)


def stopped_after(cluster, tokens_before: int, timeout_s: float = 60) -> tuple[int, int]:
    """(running, tokens out since `tokens_before`) once nothing runs on the workers, or at the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        running, tokens = running_and_tokens_out(cluster)
        if running == 0 or time.monotonic() > deadline:
            return running, tokens - tokens_before
        time.sleep(0.2)


def test_a_client_leaving_the_direct_port_aborts_its_request(cluster):
    import http.client

    tokens_before = running_and_tokens_out(cluster)[1]
    port = int(cluster.direct_url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": "a long answer nobody reads", "max_tokens": 1500, "ignore_eos": True,
        "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # gone after the first chunk
    running, tokens = stopped_after(cluster, tokens_before)
    # it stopped, and well before its 1,500 tokens: the worker aborted it
    assert running == 0 and tokens < 1000, (running, tokens)


def request_totals(url: str) -> tuple[float, float]:
    """(kvmesh_requests_total of status 200, vllm:request_success_total of every finished_reason)
    in one scrape of `url`."""
    from reliability_support import metrics

    found = metrics(url)
    return (found[f'kvmesh_requests_total{{model="{MODEL}",status="200"}}'],
            sum(v for k, v in found.items() if k.startswith("vllm:request_success_total{")))


def scrapes(cluster):
    """Scrapes through Serve's proxy and the direct port in turn: (time, totals)."""
    for i in range(1000):
        yield time.monotonic(), request_totals(cluster.direct_url if i % 2 else cluster.http_url)
        time.sleep(0.1)


def test_a_scrape_through_either_ingress_replica_shows_the_cluster_s_request_totals(cluster):
    # the baseline: scrapes through both ways agree and stay so for 2 s (past the 1 s + round
    # trips in which a request reaches the other replica's scrapes), so it is cluster-wide
    started, since, before = time.monotonic(), None, None
    for at, totals in scrapes(cluster):
        if totals != before:
            since, before = at, totals
        elif at - since >= 2.0:
            break
        assert at - started < 30, "the request totals did not settle"
    for i in range(12):  # 8 through the direct port, 4 through the proxy: both replicas get some
        status, _, _ = post(cluster, {"model": MODEL, "prompt": f"count me {i}", "max_tokens": 1},
                            base=cluster.direct_url if i % 3 else None)
        assert status == 200
    sent = time.monotonic()
    expected, seen, streak = (before[0] + 12, before[1] + 12), [], 0
    for at, totals in scrapes(cluster):
        seen.append(totals)
        assert totals[0] <= expected[0] and totals[1] <= expected[1], (expected, seen)
        streak = streak + 1 if totals == expected else 0
        if streak == 6:  # three scrapes through each way in a row
            break
        assert at - sent < 10, (expected, seen)


# ---- gRPC over two ingress replicas -----------------------------------------------------------------

LONG = 1800  # tokens: seconds of decoding on the CPU, so a stream is surely still running


def workers(cluster) -> list[dict]:
    with urllib.request.urlopen(cluster.http_url + "/v1/kvmesh/workers", timeout=30) as resp:
        return json.load(resp)["workers"]


def wait_idle(cluster, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all(w["running"] == 0 and w["waiting"] == 0 for w in workers(cluster)):
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"workers still busy after {timeout_s} s: {workers(cluster)}")


def test_cancelling_or_a_deadline_stops_grpc_streams_on_either_ingress_replica(cluster):
    """SERVING.md: with several ingress replicas, cancelling the call always works (Abort may not
    find a label held by another replica); a deadline too. Six streams (Serve's proxy spreads
    them over both replicas), each cancelled after its first message: the workers are idle within
    seconds and far fewer tokens were made than asked; then one whose deadline passes."""
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    served_by, idle_after = set(), []
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for i in range(6):
            wait_idle(cluster, 60)
            before = sum(w["tokens_out"] for w in workers(cluster))
            call = stub.Generate(pb.GenerateRequest(prompt=f"cancel me {i}", max_tokens=LONG, temperature=0,
                                                    ignore_eos=True), timeout=120)
            served_by.add(next(call).worker_id)
            call.cancel()
            idle_after.append(wait_idle(cluster, 15))
            made = sum(w["tokens_out"] for w in workers(cluster)) - before
            assert call.code() == grpc.StatusCode.CANCELLED
            assert made < LONG, (i, made)  # stopped before its end (its first message can lag on a loaded machine)
        # an idle moment of the machine can stream all LONG tokens within 3 s (CI, once): a shorter
        # deadline then, until one passes first
        for timeout in (3, 1, 0.3):
            try:
                for _ in stub.Generate(pb.GenerateRequest(prompt="until the deadline", max_tokens=LONG,
                                                          temperature=0, ignore_eos=True), timeout=timeout):
                    pass
            except grpc.RpcError as e:
                error = e
                break
        else:
            pytest.fail(f"{LONG} tokens streamed within every deadline")
        deadline_idle_s = wait_idle(cluster, 15)
    print(f"6 cancelled gRPC streams (workers {sorted(served_by)}): idle after "
          f"{', '.join(f'{s:.2f}' for s in idle_after)} s; after a deadline of {timeout} s: idle "
          f"{deadline_idle_s:.2f} s later")
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert served_by <= {w["worker"] for w in workers(cluster)} and "" not in served_by, served_by


def test_the_same_grpc_label_at_once_gets_its_own_tokens_or_already_exists(cluster):
    """RELIABILITY.md: the labels in flight are per ingress replica, and the engine's ids are the
    server's: two requests with one label sent at once each stream their own tokens (on two
    replicas) or the second is ALREADY_EXISTS (on one); never one's tokens in the other."""
    import grpc

    from kvmesh.cluster.client import grpc_stream

    wait_idle(cluster, 60)

    def run(prompt):
        try:
            return list(grpc_stream(cluster.grpc_target, prompt=prompt, max_tokens=40, temperature=0,
                                    ignore_eos=True, request_id="shared-label"))
        except grpc.RpcError as e:
            return e.code()

    for attempt in range(4):
        with cf.ThreadPoolExecutor(2) as ex:
            results = list(ex.map(run, ["first prompt of two", "the second prompt"]))
        ok = [r for r in results if isinstance(r, list)]
        assert all(r == grpc.StatusCode.ALREADY_EXISTS for r in results if not isinstance(r, list)), results
        assert ok, results
        for prompt, r in zip(["first prompt of two", "the second prompt"], results):
            if isinstance(r, list):
                alone = list(grpc_stream(cluster.grpc_target, prompt=prompt, max_tokens=40, temperature=0,
                                         ignore_eos=True, request_id="alone"))
                assert [t for m in r for t in m.token_ids] == [t for m in alone for t in m.token_ids]
                assert {m.request_id for m in r} == {"shared-label"}
                assert r[-1].usage.completion_tokens == 40
        if len(ok) == 2:
            break  # both ran at once, each with its own tokens
    print(f"same label at once: {len(ok)} of 2 ran in the last of {attempt + 1} attempts")


# ---- stored responses (server.responses_store), shared by the ingress replicas ---------------------

def clients(cluster):
    """The official client through Serve's proxy and through the direct port (either replica)."""
    import openai

    return [openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            for base in (cluster.http_url, cluster.direct_url)]


def test_a_stored_response_is_found_through_every_ingress_replica_until_deleted(cluster):
    import openai

    proxy, direct = clients(cluster)
    r = proxy.responses.create(model=MODEL, input="Keep this.", max_output_tokens=6, temperature=0, store=True)
    assert r.store is True
    # the direct port's connections land on either replica (SO_REUSEPORT): each finds it
    for client in [proxy, direct] * 4:
        assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    direct.responses.delete(r.id)
    for client in (proxy, direct):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.retrieve(r.id)
        assert e.value.body["param"] == "response_id" and e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        proxy.responses.delete(r.id)
    # store left out is not stored
    unstored = proxy.responses.create(model=MODEL, input="Forget this.", max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        direct.responses.retrieve(unstored.id)


def test_previous_response_id_runs_the_turn_after_the_stored_conversation(cluster):
    """Each turn is the chat of the whole conversation so far, as a client sending it all would
    get it: the same greedy text and the same prompt tokens; the first turn's instructions are not
    carried over."""
    proxy, direct = clients(cluster)
    sampling = {"max_output_tokens": 8, "temperature": 0}
    first = proxy.responses.create(model=MODEL, input="Name a sea.", instructions="Be brief.", store=True,
                                   **sampling)
    second = direct.responses.create(model=MODEL, input="And another.", previous_response_id=first.id,
                                     store=True, **sampling)
    third = proxy.responses.create(model=MODEL, input=[{"role": "user", "content": "A third?"}],
                                   previous_response_id=second.id, **sampling)
    assert (second.previous_response_id, third.previous_response_id, third.store) == (first.id, second.id, False)
    messages = [{"role": "user", "content": "Name a sea."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And another."}]
    for turn in (second, third):
        chat = proxy.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        assert turn.output_text == chat.choices[0].message.content
        assert turn.usage.input_tokens == chat.usage.prompt_tokens
        messages += [{"role": "assistant", "content": turn.output_text}, {"role": "user", "content": "A third?"}]
    # a response's input items: the conversation it continued and its input, newest first by default
    listed = direct.responses.input_items.list(second.id)
    assert [(item.type, item.role, item.content[0].text) for item in listed.data] == [
        ("message", "user", "And another."), ("message", "assistant", first.output_text),
        ("message", "user", "Name a sea.")]
    assert listed.data[1].id == first.output[0].id and not listed.has_more
    page = proxy.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.id for item in page.data] == [item.id for item in listed.data[::-1][:2]] and page.has_more


def test_a_streamed_stored_response_is_stored_as_its_last_event_gives_it(cluster):
    proxy, direct = clients(cluster)
    events = list(proxy.responses.create(model=MODEL, input="Stream and keep.", max_output_tokens=6,
                                         temperature=0, store=True, stream=True))
    final = events[-1].response  # completed, or incomplete at the 6 tokens
    assert events[-1].type in ("response.completed", "response.incomplete") and final.store is True
    assert direct.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_an_unknown_previous_response_id_is_a_404_naming_it_and_the_server_goes_on(cluster):
    import openai

    proxy, _ = clients(cluster)
    with pytest.raises(openai.NotFoundError) as e:
        proxy.responses.create(model=MODEL, input="x", previous_response_id="resp_nothing", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        proxy.responses.create(model=MODEL, input="x", previous_response_id=7, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    status, body, _ = post(cluster, {"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert status == 200


def finished(client, response_id: str, timeout_s: float = 120):
    """A background response read back until it is no longer queued or in progress."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_a_background_response_is_answered_queued_and_read_back_finished(cluster):
    """The same greedy text as the response asked for in the foreground; read back through either
    replica, whichever runs it; and, finished, it can be continued."""
    proxy, direct = clients(cluster)
    body = {"model": MODEL, "input": "Work on this later.", "max_output_tokens": 10, "temperature": 0, "store": True}
    queued = proxy.responses.create(**body, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = finished(direct, queued.id)
    foreground = proxy.responses.create(**body)
    assert done.status in ("completed", "incomplete") and done.output_text == foreground.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens and done.background is True
    assert proxy.responses.cancel(queued.id).status == done.status  # it had ended: returned as is
    follow = proxy.responses.create(model=MODEL, input="More.", previous_response_id=queued.id, max_output_tokens=2)
    assert follow.usage.input_tokens > foreground.usage.input_tokens


def test_cancelling_a_background_response_aborts_it_on_the_worker(cluster):
    import openai

    proxy, direct = clients(cluster)
    tokens_before = running_and_tokens_out(cluster)[1]
    queued = proxy.responses.create(model=MODEL, input="A long answer nobody waits for.", max_output_tokens=1500,
                                    temperature=0, store=True, background=True)
    deadline = time.monotonic() + 60
    while running_and_tokens_out(cluster)[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # until it generates
    assert direct.responses.cancel(queued.id).status == "cancelled"
    running, tokens = stopped_after(cluster, tokens_before)
    assert running == 0 and tokens < 1000, (running, tokens)  # stopped well before its 1,500 tokens
    assert finished(proxy, queued.id).status == "cancelled"  # its runner did not overwrite it
    with pytest.raises(openai.BadRequestError) as e:
        proxy.responses.create(model=MODEL, input="x", previous_response_id=queued.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    # only a background response can be cancelled
    stored = proxy.responses.create(model=MODEL, input="y", max_output_tokens=2, store=True)
    with pytest.raises(openai.BadRequestError) as e:
        proxy.responses.cancel(stored.id)
    assert e.value.body["param"] == "response_id"
