"""docs/SERVING.md's intro, "Run it" and "Tensor parallelism", without Ray: behaviours the doc
states that no other unit test would catch if they stopped being true ("Use it" through "API
fields": test_doc_claims_serving_api.py).

- the worker's stream (cluster/worker.py KVWorker.generate, its engine loop a stand-in): items
  after the first wait for `server.stream_interval` tokens, except with n > 1; a caller that goes
  away aborts the request on the engine;
- the KV-aware request router: one replica per rank, ranked on the request's block hashes;
- the KV event hub: named per app, detached, 0 CPUs, removed when `kvmesh serve` stops;
- `kvmesh serve`'s options over the config, `--grpc-port 0` (no gRPC), `--direct-http-port 0`;
- tensor parallelism's rendezvous and loopback interfaces;
- `kvmesh client`'s default endpoints;
- lm-eval in CI: the README's test command installs the `[eval]` extra.
"""

import asyncio
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

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
    from kvmesh.cluster.request_router import KVAwareRequestRouter

    asked = []

    class Ranking:  # the RoutingState's rank(): the policy's order of the workers
        def rank(self, block_hashes, num_prompt_tokens, session_key, workers, avoid):
            asked.append((block_hashes, num_prompt_tokens, session_key, sorted(workers), avoid))
            return ["w2", "w1", "w3"]

    router = KVAwareRequestRouter.__new__(KVAwareRequestRouter)
    router.state, router._synced = Ranking(), asyncio.Event()
    router._synced.set()
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=w)) for w in ("w1", "w2", "w3")]
    request = RoutedRequest("req-1", [1] * 40, SamplingParams(), block_hashes=[11, 22],
                            session_key="alice", avoid_workers=["w9"])
    ranked = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[request])))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranked] == [["w2"], ["w1"], ["w3"]]
    assert asked == [([11, 22], 40, "alice", ["w1", "w2", "w3"], ["w9"])]
    assert asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[]))) == [replicas]


# ---- the KV event hub ------------------------------------------------------------------------------

def test_the_hub_is_a_detached_zero_cpu_actor_named_after_the_app_in_the_serve_namespace(monkeypatch):
    """Intro: "a named, detached Ray actor per app (`kvmesh-kv-events-<app>`, namespace `serve`)";
    "the hub (0 CPUs) stays"."""
    from kvmesh.cluster import event_hub

    asked = {}

    class Options:
        def remote(self):
            return "handle"

    monkeypatch.setattr(event_hub.KVEventHub, "options", lambda **kw: asked.update(kw) or Options())
    assert event_hub.get_or_create_hub("myapp") == "handle"
    assert asked == {"name": "kvmesh-kv-events-myapp", "namespace": "serve", "get_if_exists": True,
                     "lifetime": "detached"}
    assert event_hub.KVEventHub._default_options["num_cpus"] == 0


# ---- kvmesh serve's options ----------------------------------------------------------------------

def serve_args(*argv):
    from kvmesh.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_kvmesh_serve_options_override_the_config(tmp_path):
    """Run it: "Options override the config: `--replicas`, `--device cpu|cuda` (`cpu` also sets
    `replicas.num_gpus: 0`), `--model`, `--policy`, `--host`, `--http-port`, `--grpc-port` ...,
    `--direct-http-port` ..."."""
    from kvmesh.commands.serve import load_with_overrides

    config = tmp_path / "serve.yaml"
    config.write_text("model: random:tiny-llama\nreplicas: {num_replicas: 1, num_gpus: 1}\n"
                      "routing: {policy: kv_events}\n"
                      "server: {host: 127.0.0.1, http_port: 8000, grpc_port: 9000, direct_http_port: 0}\n")
    cfg = load_with_overrides(serve_args(
        str(config), "--replicas", "3", "--device", "cpu", "--model", "random:tiny-qwen3",
        "--policy", "round_robin", "--host", "0.0.0.0", "--http-port", "8100", "--grpc-port", "0",
        "--direct-http-port", "8200"))
    assert (cfg.replicas.num_replicas, cfg.engine.device, cfg.replicas.num_gpus) == (3, "cpu", 0)
    assert (cfg.model, cfg.routing.policy) == ("random:tiny-qwen3", "round_robin")
    assert (cfg.server.host, cfg.server.http_port, cfg.server.grpc_port,
            cfg.server.direct_http_port) == ("0.0.0.0", 8100, 0, 8200)
    assert load_with_overrides(serve_args(str(config))).server.grpc_port == 9000  # no option: the file's


@pytest.mark.parametrize("grpc_port, direct_port", [(0, 0), (9100, 8200)])
def test_grpc_port_0_starts_no_grpc_and_direct_http_port_0_no_direct_port(monkeypatch, grpc_port, direct_port):
    """Run it: "`--grpc-port` (0 = no gRPC), `--direct-http-port` (the ingress replicas' own HTTP
    port ...; 0 = off)"."""
    from ray import serve

    from kvmesh.cluster import app, launcher

    started = {}
    monkeypatch.setattr(serve, "start", lambda **kw: started.update(kw))
    monkeypatch.setattr(serve, "run", lambda *a, **kw: None)
    monkeypatch.setattr(app, "build_app", lambda args: args)
    cfg = parse_config({"model": MODEL, "server": {"grpc_port": grpc_port, "direct_http_port": direct_port}})
    endpoints = launcher.deploy(cfg)
    assert endpoints["http"] == "http://127.0.0.1:8000/v1"
    if grpc_port:
        assert started["grpc_options"].port == grpc_port and endpoints["grpc"] == "127.0.0.1:9100"
        assert endpoints["http_direct"] == "http://127.0.0.1:8200/v1"
    else:
        assert started["grpc_options"] is None and "grpc" not in endpoints
        assert "http_direct" not in endpoints


# ---- tensor parallelism ------------------------------------------------------------------------------

def test_tensor_parallel_ranks_meet_through_a_private_file_with_loopback_socket_interfaces(monkeypatch):
    """Tensor parallelism: "The ranks meet through a file in a private temporary directory (no
    rendezvous port), and gloo and NCCL keep their sockets on the loopback interface
    (`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` default to `lo`)"."""
    import os
    import stat

    from kvmesh.worker import tensor_parallel

    joined = {}
    monkeypatch.setattr(tensor_parallel.dist, "init_process_group",
                        lambda backend, init_method, **kw: joined.update(backend=backend, init_method=init_method))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    path = tensor_parallel.rendezvous_file()
    tensor_parallel.init_group(0, 2, path, torch.device("cpu"))
    assert joined == {"backend": "gloo", "init_method": f"file://{path}"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700  # this user's only
    os.rmdir(os.path.dirname(path))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")  # a default: the operator's setting stays
    tensor_parallel.init_group(0, 2, path, torch.device("cpu"))
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"


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
