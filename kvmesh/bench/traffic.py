"""A bounded, mixed client load against a kvmesh cluster's OpenAI HTTP API, used by the fault and
soak tests and by `kvmesh bench soak`.

Four kinds of request, each with a hard deadline (a request that outlives it is "hung"):
- whole: non-streaming; retried (honouring Retry-After, at most `max_attempts`) on 429, 5xx and
  connection errors, as the OpenAI clients do;
- stream: streaming, read to `data: [DONE]`; retried like `whole` while no chunk has arrived (the
  user has seen nothing); afterwards it must end with [DONE], as complete ("ok") or with a chunk
  whose finish_reason is "error" ("error_ended"); a stream whose connection drops without either
  is "cut";
- abort: streaming, the client disconnects after its first content chunk (mid-stream);
- grpc: kvmesh.v1 Generate (a stream) on `grpc_target`, read to its status: OK with a last message
  whose finish_reason is "error" is "error_ended" (after tokens), any other OK "ok"; a failing
  status counts as the HTTP status the ingress answers for the same error (GRPC_AS_HTTP) and is
  retried like `stream` (the retry-after its details name) while no token has arrived, "cut" after.

Plain threads and http.client: a disconnect is a closed socket, exactly what a client does.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

RETRY_STATUSES = {429, 500, 502, 503, 504}
# a gRPC status as the HTTP status the ingress answers for the same error (cluster/grpc_service.py);
# any other failing status as 500
GRPC_AS_HTTP = {"OK": 200, "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404,
                "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}


@dataclass
class Outcome:
    kind: str  # whole | stream | abort | grpc
    result: str  # ok | error_ended | aborted | cut | failed | hung
    attempts: int = 0
    tokens: int = 0
    latency_s: float = 0.0
    statuses: list[int] = field(default_factory=list)  # HTTP's, or gRPC's as GRPC_AS_HTTP
    detail: str = ""
    started_at: float = 0.0  # time.monotonic()
    plain_errors: int = 0  # error answers whose body is not JSON (a server must never send one)


class Traffic:
    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 60.0, max_attempts: int = 8, max_tokens: int = 16,
                 max_retry_wait_s: float = 2.0, seed: int = 0, shared_prefixes: int = 4,
                 grpc_target: str | None = None):
        """grpc_target (host:port of the cluster's gRPC API): for requests of the kind grpc."""
        self.grpc_target = grpc_target
        url = urllib.parse.urlparse(base_url)
        self.host, self.port = url.hostname, url.port or 80
        self.model, self.api_key = model, api_key
        self.timeout_s, self.max_attempts, self.max_tokens = timeout_s, max_attempts, max_tokens
        self.max_retry_wait_s = max_retry_wait_s
        self.seed = seed
        self.shared_prefixes = shared_prefixes  # 0: every prompt distinct (no cache affinity)

    # ---- one request ---------------------------------------------------------------------------

    def _prompt(self, i: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + i)
        if self.shared_prefixes:  # a few shared prefixes, so the prefix cache and router work
            tenant = rng.randrange(self.shared_prefixes)
            return f"Tenant {tenant} instructions: answer briefly and politely. " * 3 + f"Question {i}?"
        return f"Question {i} ({self.seed}): " + " ".join(str(rng.randrange(10**6)) for _ in range(40))

    def _body(self, i: int, stream: bool) -> bytes:
        body = {"model": self.model, "prompt": self._prompt(i), "max_tokens": self.max_tokens,
                "temperature": 0.7, "seed": i, "ignore_eos": True, "stream": stream}
        return json.dumps(body).encode()

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def one(self, i: int, kind: str) -> Outcome:
        if kind == "grpc":
            return self._one_grpc(i)
        start = time.monotonic()
        deadline = start + self.timeout_s
        out = Outcome(kind, "failed", started_at=start)
        for remaining in self._attempts(out, deadline):
            conn = http.client.HTTPConnection(self.host, self.port, timeout=remaining)
            retry_after = 0.2
            try:
                conn.request("POST", "/v1/completions", self._body(i, kind != "whole"), self._headers())
                resp = conn.getresponse()
                out.statuses.append(resp.status)
                if resp.status != 200:
                    out.plain_errors += not _is_json(resp.read())
                    out.detail = f"HTTP {resp.status}"
                    if resp.status not in RETRY_STATUSES:
                        break
                    retry_after = float(resp.getheader("Retry-After") or 0.2)
                elif kind == "whole":
                    body = json.loads(resp.read())
                    out.tokens = body["usage"]["completion_tokens"]
                    out.result = "ok"
                    break
                else:
                    seen = self._read_stream(resp, conn, out, abort=kind == "abort")
                    if seen or out.result in ("ok", "error_ended", "aborted"):
                        break  # the user saw output: never re-run
            except TimeoutError:
                out.result, out.detail = "hung", "no answer before the deadline"
                break
            except (OSError, http.client.HTTPException, ValueError) as e:
                out.detail = f"{type(e).__name__}: {e}"
                if out.tokens:  # cut mid-stream
                    out.result = "cut"
                    break
            finally:
                conn.close()
            self._pause(retry_after, deadline)
        out.latency_s = time.monotonic() - start
        return out

    def _attempts(self, out: Outcome, deadline: float):
        """Each attempt of a request: yields the time left before its deadline, at most
        max_attempts times (counted in out.attempts); the caller breaks out once the request has
        ended. The deadline passed first: out is "hung". The attempts ran out: says so in out."""
        while out.attempts < self.max_attempts:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                out.result = "hung"
                return
            out.attempts += 1
            yield remaining
        out.detail = out.detail or "no attempts left"

    def _pause(self, wait_s: float, deadline: float) -> None:
        """Before a retry: the server's wait, capped by max_retry_wait_s and by the deadline."""
        time.sleep(min(wait_s, self.max_retry_wait_s, max(0.0, deadline - time.monotonic())))

    def _one_grpc(self, i: int) -> Outcome:
        import grpc

        from kvmesh.proto import kvmesh_pb2 as pb
        from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

        if not self.grpc_target:
            raise ValueError("requests of the kind grpc need grpc_target")
        start = time.monotonic()
        deadline = start + self.timeout_s
        out = Outcome("grpc", "failed", started_at=start)
        request = pb.GenerateRequest(model=self.model, prompt=self._prompt(i), max_tokens=self.max_tokens,
                                     temperature=0.7, seed=i, ignore_eos=True)
        metadata = [("authorization", f"Bearer {self.api_key}")] if self.api_key else None
        with grpc.insecure_channel(self.grpc_target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for remaining in self._attempts(out, deadline):
                finish = ""
                try:
                    for message in stub.Generate(request, timeout=remaining, metadata=metadata):
                        out.tokens += len(message.token_ids)
                        finish = message.finish_reason or finish
                except grpc.RpcError as e:
                    name = e.code().name
                    out.detail = f"gRPC {name}: {e.details()}"
                    if name == "DEADLINE_EXCEEDED":
                        out.result = "hung"
                        break
                    out.statuses.append(GRPC_AS_HTTP.get(name, 500))
                    if out.tokens:  # cut mid-stream
                        out.result = "cut"
                        break
                    if out.statuses[-1] not in RETRY_STATUSES:
                        break
                    hint = re.search(r"retry-after: (\d+) s", e.details() or "")
                    self._pause(float(hint.group(1)) if hint else 0.2, deadline)
                    continue
                out.statuses.append(200)
                if finish == "error" and not out.tokens:
                    out.detail = "an error before any token, with status OK"
                else:
                    out.result = "error_ended" if finish == "error" else "ok"
                break
        out.latency_s = time.monotonic() - start
        return out

    def _read_stream(self, resp, conn, out: Outcome, abort: bool) -> bool:
        """Read SSE lines; returns whether any content reached the client."""
        finish = None
        while True:
            line = resp.readline()
            if not line:  # connection closed before [DONE]
                out.result = "cut" if out.tokens else "failed"
                out.detail = "stream closed before [DONE]"
                return out.tokens > 0
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                out.result = "error_ended" if finish == "error" else "ok"
                return True
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    out.tokens += 1
                finish = choice.get("finish_reason") or finish
            if abort and out.tokens:
                out.result = "aborted"
                conn.sock.shutdown(socket.SHUT_RDWR)  # a client that goes away mid-stream
                return True

    # ---- many requests -------------------------------------------------------------------------

    def run(self, num_requests: int, concurrency: int, mix: dict[str, float],
            stop_after_s: float | None = None, on_done=None) -> list[Outcome]:
        """`num_requests` requests of kinds drawn from `mix` (weights), `concurrency` at a time;
        stops issuing new ones after stop_after_s. on_done(i, outcome) runs after each."""
        rng = random.Random(self.seed)
        kinds = rng.choices(list(mix), weights=list(mix.values()), k=num_requests)
        results: list[Outcome | None] = [None] * num_requests
        started = time.monotonic()
        lock = threading.Lock()

        def task(i):
            if stop_after_s is not None and time.monotonic() - started > stop_after_s:
                return
            o = self.one(i, kinds[i])
            with lock:
                results[i] = o
            if on_done is not None:
                on_done(i, o)

        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(task, range(num_requests)))
        return [r for r in results if r is not None]


    def run_for(self, duration_s: float, concurrency: int, mix: dict[str, float],
                on_done=None) -> list[Outcome]:
        """Requests of kinds drawn from `mix`, `concurrency` at a time, until duration_s has
        passed (requests in flight then are finished, each within its own deadline)."""
        rng = random.Random(self.seed)
        kinds, weights = list(mix), list(mix.values())
        results: list[Outcome] = []
        lock = threading.Lock()
        counter = iter(range(10**12))
        end = time.monotonic() + duration_s

        def loop():
            while time.monotonic() < end:
                with lock:
                    i = next(counter)
                    kind = rng.choices(kinds, weights=weights)[0]
                o = self.one(i, kind)
                with lock:
                    results.append(o)
                if on_done is not None:
                    on_done(i, o)

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def summarize(outcomes: list[Outcome]) -> dict:
    by = Counter((o.kind, o.result) for o in outcomes)
    return {"requests": len(outcomes),
            "by_kind_result": {f"{k}:{r}": n for (k, r), n in sorted(by.items())},
            "retried": sum(1 for o in outcomes if o.attempts > 1),
            "plain_text_errors": sum(o.plain_errors for o in outcomes),
            "lost": sum(1 for o in outcomes if o.result in ("failed", "hung")
                        or (o.kind == "whole" and o.result != "ok"))}


def _is_json(body: bytes) -> bool:
    try:
        json.loads(body)
        return True
    except ValueError:
        return False
