"""docs/SERVING.md's intro, "Run it" and "Tensor parallelism", without Ray: behaviours the doc
states that no other unit test would catch if they stopped being true ("Use it" through "API
fields": test_doc_claims_serving_api.py).

- the worker's stream (cluster/worker.py KVWorker.generate, its engine loop a stand-in): items
  after the first wait for `server.stream_interval` tokens, except with n > 1; a caller that goes
  away aborts the request on the engine;
- the KV-aware request router: one replica per rank, ranked on the request's block hashes;
- `kvmesh serve`'s options over the config;
- tensor parallelism's rendezvous and loopback interfaces (two real gloo ranks in processes of
  their own);
- `kvmesh client`'s default endpoints;
- lm-eval in CI: the README's test command installs the `[eval]` extra.
"""

import asyncio
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvmesh.protocol import TokenDelta
from kvmesh.sampling_params import SamplingParams
from kvmesh.serve_config import parse_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:tiny-llama"


# ---- the worker's stream -------------------------------------------------------------------------

class EngineLoopStandIn:
    """What KVWorker.generate uses of its EngineLoop: submit() gives the request's delta queue."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.aborted: list[str] = []

    def submit(self, request):
        return self.queue

    def abort(self, request_id):
        self.aborted.append(request_id)


def kv_worker(stream_interval: int):
    from kvmesh.cluster.slo_window import LatencyWindow
    from kvmesh.cluster.worker import KVWorker

    worker = KVWorker.__new__(KVWorker)  # no Serve replica, no engine: the stand-in's deltas
    worker.config = parse_config({"model": MODEL, "server": {"stream_interval": stream_interval}})
    worker.worker_id, worker.loop, worker.latency = "w", EngineLoopStandIn(), LatencyWindow(30)
    return worker


def routed(n: int = 1):
    from kvmesh.cluster.messages import RoutedRequest

    return RoutedRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=16, n=n))


def token(index: int = 0, finish: str | None = None, more: bool = False) -> TokenDelta:
    return TokenDelta("req-1", [65], "A", finish_reason=finish, index=index, more_sequences=more)


async def settled():
    for _ in range(20):  # let every ready task run: the generator is waiting on the queue
        await asyncio.sleep(0)


def test_after_the_first_token_a_stream_item_waits_for_stream_interval_tokens():
    """Intro: "after the first token an item waits for `server.stream_interval` tokens"."""
    async def run():
        worker = kv_worker(stream_interval=4)
        stream = worker.generate(routed())
        queue = worker.loop.queue
        queue.put_nowait(token())
        assert len((await anext(stream)).token_ids) == 1  # the first token goes at once
        queue.put_nowait(token()), queue.put_nowait(token())
        item = asyncio.ensure_future(anext(stream))
        await settled()
        assert not item.done()  # 2 tokens: held for 4
        queue.put_nowait(token()), queue.put_nowait(token())
        assert len((await item).token_ids) == 4
        queue.put_nowait(token(finish="length"))  # the finish is not held back
        last = await anext(stream)
        assert (len(last.token_ids), last.finish_reason) == (1, "length")
        assert worker.loop.aborted == []

    asyncio.run(run())


def test_with_n_above_1_each_delta_goes_out_as_it_comes():
    """Intro: "(default 1; a request with `n` > 1 sends each delta as it comes)"."""
    async def run():
        worker = kv_worker(stream_interval=4)
        stream = worker.generate(routed(n=2))
        queue = worker.loop.queue
        queue.put_nowait(token(0, more=True)), queue.put_nowait(token(1, more=True))
        first, second = await anext(stream), await anext(stream)
        assert [(d.index, len(d.token_ids)) for d in (first, second)] == [(0, 1), (1, 1)]
        queue.put_nowait(token(0, more=True))
        assert len((await asyncio.wait_for(anext(stream), 5)).token_ids) == 1  # not held for 4

    asyncio.run(run())


def test_the_stream_interval_is_1_by_default():
    """Intro: "`server.stream_interval` tokens (default 1 ...)"."""
    assert parse_config({"model": MODEL}).server.stream_interval == 1


def test_a_caller_that_goes_away_aborts_its_request_on_the_engine():
    """Intro: "when the caller goes away the request is aborted on the engine and its KV blocks
    freed" (the engine frees an aborted request's blocks: test_parallel_sampling.py)."""
    async def run():
        worker = kv_worker(stream_interval=1)
        stream = worker.generate(routed())
        worker.loop.queue.put_nowait(token())
        await anext(stream)
        await stream.aclose()  # Serve closes the generator when the caller goes away
        assert worker.loop.aborted == ["req-1"]

    asyncio.run(run())


# ---- the KV-aware request router ------------------------------------------------------------------

def test_the_request_router_ranks_replicas_on_the_requests_block_hashes_one_replica_per_rank():
    """Intro: "For each request it ranks the replicas with the configured policy on the request's
    block hashes (`pending_request.args[0]`) and returns one replica per rank"; a call that is no
    request (model_info, load) may go to any replica."""
    from kvmesh.cluster.messages import RoutedRequest

    asked = []

    class Ranking:  # the RoutingState's rank(): the policy's order of the workers
        def rank(self, block_hashes, num_prompt_tokens, session_key, workers, avoid, request_id,
                 keep_stale):
            asked.append((block_hashes, num_prompt_tokens, session_key, sorted(workers), avoid, request_id,
                          keep_stale))
            return ["w2", "w1", "w3"]

    router, replicas = _router_over(Ranking(), ["w1", "w2", "w3"])
    request = RoutedRequest("req-1", [1] * 40, SamplingParams(), block_hashes=[11, 22],
                            session_key="alice", avoid_workers=["w9"])
    ranked = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[request])))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranked] == [["w2"], ["w1"], ["w3"]]
    assert asked == [([11, 22], 40, "alice", ["w1", "w2", "w3"], ["w9"], "req-1", False)]
    assert asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[]))) == [replicas]


def test_a_worker_that_stopped_reporting_is_not_among_the_ranks_serve_gets_while_another_can_serve():
    """Intro: "A worker that has stopped reporting its load (3 s) or reports its engine stalled is
    left out while another can serve, so spill-over never lands on it." With a real RoutingState:
    the stalled holder of the whole prompt is not in the ranks; with every worker silent, all are."""
    from test_routing_stale_worker import HASHES, PROMPT, _stale_setup

    from kvmesh.cluster.messages import RoutedRequest

    clock, state, report = _stale_setup(HASHES)  # "holder" holds the whole prompt, "other" nothing
    router, replicas = _router_over(state, ["holder", "other"])

    def ranks():
        request = RoutedRequest("req-1", PROMPT, SamplingParams(), block_hashes=HASHES)
        ranked = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[request])))
        return [[r.replica_id.unique_id for r in rank] for rank in ranked]

    report(1.0, ["holder", "other"])
    assert ranks() == [["holder"], ["other"]]  # the holder first
    clock["now"] += 4.0  # past the setup's 3 s
    report(2.0, ["other"])  # the holder has gone silent
    assert ranks() == [["other"]]
    clock["now"] += 4.0  # both silent: both listed, the holder first
    assert ranks() == [["holder"], ["other"]]
    report(50.0, ["holder", "other"], stalled=["other"])  # both report; other's engine is stalled
    assert ranks() == [["holder"]]


def _router_over(state, worker_ids: list[str]):
    """A KVAwareRequestRouter ranking from `state` (synced, no hub), and a stand-in replica per
    worker id, as Serve passes them to choose_replicas."""
    from kvmesh.cluster.request_router import KVAwareRequestRouter

    router = KVAwareRequestRouter.__new__(KVAwareRequestRouter)
    router.state, router._synced = state, asyncio.Event()
    router._synced.set()
    return router, [SimpleNamespace(replica_id=SimpleNamespace(unique_id=w)) for w in worker_ids]


# ---- the KV event hub ------------------------------------------------------------------------------

# Named, detached, 0 CPUs, in namespace `serve`: on a real Ray in
# tests/integration/test_doc_claims_ray_live.py.


# ---- kvmesh serve's options ----------------------------------------------------------------------

def serve_args(*argv):
    from kvmesh.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_asks_the_first_ranked_replica_for_its_queue_length_with_a_half_second_deadline():
    # RELIABILITY.md ("Known limit"): the names are Serve's RequestRouter's, so Serve reads them
    from ray.serve._private.request_router.request_router import RequestRouter

    from kvmesh.cluster.request_router import KVAwareRequestRouter

    assert issubclass(KVAwareRequestRouter, RequestRouter)
    for name in ("queue_len_response_deadline_s", "max_queue_len_response_deadline_s"):
        assert name in vars(RequestRouter), name  # not a name of kvmesh's own
    assert KVAwareRequestRouter.queue_len_response_deadline_s == 0.5
    assert KVAwareRequestRouter.max_queue_len_response_deadline_s == 2.0


def test_kvmesh_serve_options_override_the_config(tmp_path):
    """Run it: "Options override the config: `--replicas`, `--device cpu|cuda` (`cpu` also sets
    `replicas.num_gpus: 0`), `--model`, `--policy`, `--host`, `--http-port`, `--grpc-port` ...,
    `--direct-http-port` ..., `--responses-store N` ..., `--scheduling-policy fcfs|priority`,
    `--max-num-seqs N`, `--max-ongoing-requests N`, `--trust-request-chat-template`,
    `--reasoning-parser qwen3|deepseek_r1`"."""
    from kvmesh.commands.serve import load_with_overrides

    config = tmp_path / "serve.yaml"
    config.write_text("model: random:tiny-llama\nreplicas: {num_replicas: 1, num_gpus: 1}\n"
                      "routing: {policy: kv_events}\n"
                      "server: {host: 127.0.0.1, http_port: 8000, grpc_port: 9000, direct_http_port: 0}\n")
    cfg = load_with_overrides(serve_args(
        str(config), "--replicas", "3", "--device", "cpu", "--model", "random:tiny-qwen3",
        "--policy", "round_robin", "--host", "0.0.0.0", "--http-port", "8100", "--grpc-port", "0",
        "--direct-http-port", "8200", "--responses-store", "50", "--scheduling-policy", "priority",
        "--max-num-seqs", "4", "--max-ongoing-requests", "256", "--trust-request-chat-template",
        "--reasoning-parser", "deepseek_r1"))
    assert (cfg.replicas.num_replicas, cfg.engine.device, cfg.replicas.num_gpus) == (3, "cpu", 0)
    assert (cfg.model, cfg.routing.policy) == ("random:tiny-qwen3", "round_robin")
    assert (cfg.server.host, cfg.server.http_port, cfg.server.grpc_port,
            cfg.server.direct_http_port, cfg.server.responses_store) == ("0.0.0.0", 8100, 0, 8200, 50)
    assert (cfg.engine.scheduling_policy, cfg.engine.max_num_seqs, cfg.replicas.max_ongoing_requests) == (
        "priority", 4, 256)
    assert cfg.server.trust_request_chat_template is True and cfg.server.reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="engine.max_num_seqs"):
        load_with_overrides(serve_args(str(config), "--max-num-seqs", "0"))
    plain = load_with_overrides(serve_args(str(config)))
    assert plain.server.grpc_port == 9000 and plain.server.trust_request_chat_template is False  # the file's
    assert plain.server.reasoning_parser is None


# `--grpc-port 0` (no gRPC) and `--direct-http-port 0` (off) on running clusters:
# tests/integration/test_patches_on_started_clusters.py (both 0) and test_cluster_serving.py
# (gRPC on, direct 0); a direct port set: test_listeners.py, test_cluster_ingress_replicas.py.


# ---- tensor parallelism ------------------------------------------------------------------------------

# One rank of a CPU group, as a worker's engine and its followers join it (tensor_parallel.init_group
# with the rendezvous file): an all-reduce, then what the rank saw. A rank whose join fails says why.
TP_RANK = """
import json, os, sys
import psutil, torch
from kvmesh.worker import tensor_parallel
rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def env():
    return {name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
try:
    tp = tensor_parallel.init_group(rank, size, path, torch.device("cpu"))
except Exception as e:
    print(json.dumps({"error": str(e), "env": env()}))
    sys.exit(0)
x = torch.tensor([rank + 1.0])
tp.all_reduce(x)
def ip(address):  # 127.0.0.1 on an IPv6 socket is ::ffff:127.0.0.1
    return address.ip.removeprefix("::ffff:") if address else None
sockets = [[ip(c.laddr), ip(c.raddr), c.status] for c in psutil.Process().net_connections("inet")]
print(json.dumps({"sum": x.item(), "env": env(), "store": os.path.isfile(path), "sockets": sockets}))
tensor_parallel.destroy_group()
"""


def _run_ranks(size: int, path: str, **env) -> list[dict]:
    """`size` rank processes of one group (TP_RANK), run to their end; what each printed."""
    import json
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    procs = [subprocess.Popen([sys.executable, "-c", TP_RANK, str(rank), str(size), path],
                              env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT) for rank in range(size)]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return out


def test_tensor_parallel_ranks_meet_through_a_private_file_with_loopback_socket_interfaces():
    """Tensor parallelism: "The ranks meet through a file in a private temporary directory (no
    rendezvous port), and gloo and NCCL keep their sockets on the loopback interface
    (`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` default to `lo`)"."""
    import os
    import shutil
    import stat

    from kvmesh.worker import tensor_parallel

    path = tensor_parallel.rendezvous_file()
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700  # this user's only
        # Two real ranks (gloo on the CPU, neither variable set): they meet through the file and
        # all-reduce; every socket of theirs is on the loopback interface.
        ranks = _run_ranks(2, path)
        for rank in ranks:
            assert rank["sum"] == 3.0, rank  # 1 + 2: the two met
            assert rank["store"], rank  # the group's store is the file
            assert rank["env"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}, rank
            assert rank["sockets"], rank  # gloo's pair sockets (not vacuous)
            ends = {ip for laddr, raddr, _ in rank["sockets"] for ip in (laddr, raddr) if ip}
            assert ends <= {"127.0.0.1", "::1"}, rank["sockets"]
            listening = [s for s in rank["sockets"] if s[2] == "LISTEN"]
            assert all(s[0] in ("127.0.0.1", "::1") for s in listening), listening
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    # A default only: the operator's interface is the one gloo is given (here one that does not
    # exist, so nothing binds anywhere: gloo refuses it by name).
    path = tensor_parallel.rendezvous_file()
    try:
        [rank] = _run_ranks(1, path, GLOO_SOCKET_IFNAME="kvmesh-none0")
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    assert rank["env"]["GLOO_SOCKET_IFNAME"] == "kvmesh-none0", rank
    assert "kvmesh-none0" in rank.get("error", ""), rank


# ---- kvmesh client --------------------------------------------------------------------------------

def test_kvmesh_client_defaults_to_the_local_servers_http_and_grpc_ports():
    """Use it: "kvmesh client ... --grpc  # streams from 127.0.0.1:9000"; "the same over HTTP"
    (kvmesh serve's default ports: `OpenAI HTTP: http://127.0.0.1:8000/v1`)."""
    from kvmesh.cli import build_parser

    args = build_parser().parse_args(["client", "What is the capital of France?", "--grpc"])
    assert (args.grpc, args.target, args.url) == (True, "127.0.0.1:9000", "http://127.0.0.1:8000/v1")


# ---- lm-eval in CI --------------------------------------------------------------------------------

def test_the_readme_test_command_installs_the_eval_extra_that_holds_lm_eval():
    """Several completions: "the README's test command installs the `[eval]` extra, so CI runs it"
    (test_cluster_serving.py's lm-eval test skips without lm-eval); "lm-eval 0.4.13"."""
    command = next(line for line in (ROOT / "README.md").read_text().splitlines()
                   if "pip install" in line and "pytest" in line)
    extras = re.search(r"-e '\.\[([^\]]*)\]'", command).group(1).split(",")
    assert "eval" in extras, command
    eval_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["eval"]
    assert any(re.match(r"lm-eval(\[[^\]]*\])?==0\.4\.13$", req) for req in eval_extra), eval_extra
