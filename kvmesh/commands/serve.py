"""`kvmesh serve`, `kvmesh client`, `kvmesh status`: run a cluster and talk to it.

Only argparse here; Ray, Serve and gRPC are imported inside the handlers.
"""

import argparse
import sys

from kvmesh.commands import add_command


def register(subparsers) -> None:
    p = add_command(subparsers, "serve", run_serve, help="serve a model on Ray Serve (OpenAI HTTP + gRPC)")
    p.add_argument("config", nargs="?", help="serving config YAML (see deploy/serve.yaml)")
    p.add_argument("--replicas", type=int, help="worker replicas (replicas.num_replicas)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="engine device; cpu also sets replicas.num_gpus to 0")
    p.add_argument("--model", help="model name, Hugging Face directory or random:<preset>")
    p.add_argument("--policy", help="routing policy (routing.policy)")
    p.add_argument("--host", help="HTTP bind address (server.host)")
    p.add_argument("--http-port", type=int, help="OpenAI HTTP port (server.http_port)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (server.grpc_port; 0 = off)")
    p.add_argument("--direct-http-port", type=int,
                   help="also serve the OpenAI API from the ingress replicas' own HTTP server on this "
                        "port, skipping Serve's proxy (server.direct_http_port; 0 = off)")
    p.add_argument("--responses-store", type=int, metavar="N",
                   help="keep up to N /v1/responses responses asked for with store: true "
                        "(server.responses_store; 0 = off)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   help="each worker's queue order (engine.scheduling_policy): fcfs, or priority by "
                        "the requests' `priority` field (lower first)")
    p.add_argument("--max-num-seqs", type=int, metavar="N",
                   help="requests each worker runs at once (engine.max_num_seqs)")
    p.add_argument("--max-ongoing-requests", type=int, metavar="N",
                   help="requests each worker accepts at once, running or queued in its engine "
                        "(replicas.max_ongoing_requests)")
    p.add_argument("--trust-request-chat-template", action="store_true", default=None,
                   help="let chat requests send their own Jinja chat_template "
                        "(server.trust_request_chat_template; vLLM's flag of the same name)")
    p.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"],
                   help="split a reasoning model's <think> block out of chat answers into `reasoning` "
                        "(server.reasoning_parser; vLLM's flag of the same name)")
    p.add_argument("--address", help="join a running Ray cluster at ADDR instead of starting one")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this bearer token (repeat for several; adds to server.api_keys; "
                        "the KVMESH_API_KEYS environment variable of the ingress adds more)")
    p.add_argument("--emit-serve-config", nargs="?", const="-", metavar="PATH",
                   help="write the equivalent Serve config (for `serve deploy`) to PATH or stdout "
                        "and exit")

    c = add_command(subparsers, "client", run_client,
                    help="stream a completion from a running kvmesh cluster")
    c.add_argument("prompt", help="the user message (chat) or prompt text (--raw)")
    c.add_argument("--grpc", action="store_true", help="use the gRPC API instead of HTTP")
    c.add_argument("--url", default="http://127.0.0.1:8000/v1", help="OpenAI base URL (HTTP)")
    c.add_argument("--target", default="127.0.0.1:9000", help="host:port of the gRPC API")
    c.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), as kvmesh generate")
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--api-key", default=None,
                   help="bearer token to send (default: $KVMESH_API_KEY)")

    s = add_command(subparsers, "status", run_status,
                    help="replicas, load, KV usage and hit rates of a running cluster")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the HTTP API (default)")
    s.add_argument("--address", default=None,
                   help="a Ray cluster address (e.g. auto, or HOST:6379): read the workers from the cluster "
                        "itself instead of the HTTP API, with Serve's replica states")
    s.add_argument("--app-name", default="kvmesh", help="Serve application name (with --address)")
    s.add_argument("--api-key", default=None, help="bearer token to send (default: $KVMESH_API_KEY)")
    s.add_argument("--json", action="store_true", help="print one JSON object")


def load_with_overrides(args):
    from kvmesh.serve_config import load_config, parse_config

    cfg = load_config(args.config).to_dict()
    if args.model:
        cfg["model"] = args.model
    if args.replicas is not None:
        cfg["replicas"]["num_replicas"] = args.replicas
    if args.device:
        cfg["engine"]["device"] = args.device
        if args.device == "cpu":
            cfg["replicas"]["num_gpus"] = 0
    if args.policy:
        cfg["routing"]["policy"] = args.policy
    if args.host:
        cfg["server"]["host"] = args.host
    if args.http_port is not None:
        cfg["server"]["http_port"] = args.http_port
    if args.grpc_port is not None:
        cfg["server"]["grpc_port"] = args.grpc_port
    if args.direct_http_port is not None:
        cfg["server"]["direct_http_port"] = args.direct_http_port
    if getattr(args, "responses_store", None) is not None:
        cfg["server"]["responses_store"] = args.responses_store
    if getattr(args, "scheduling_policy", None):
        cfg["engine"]["scheduling_policy"] = args.scheduling_policy
    if getattr(args, "max_num_seqs", None) is not None:
        cfg["engine"]["max_num_seqs"] = args.max_num_seqs
    if getattr(args, "max_ongoing_requests", None) is not None:
        cfg["replicas"]["max_ongoing_requests"] = args.max_ongoing_requests
    if getattr(args, "reasoning_parser", None):
        cfg["server"]["reasoning_parser"] = args.reasoning_parser
    if getattr(args, "trust_request_chat_template", None):
        cfg["server"]["trust_request_chat_template"] = True
    for key in getattr(args, "api_key", None) or []:
        if key not in cfg["server"]["api_keys"]:
            cfg["server"]["api_keys"].append(key)
    return parse_config(cfg)


def run_serve(args) -> int:
    """Start a local Ray (or join --address) and deploy the kvmesh cluster: worker replicas routed by
    KV events, an OpenAI-compatible HTTP API and a gRPC API. Without a config it serves the default
    model on one replica."""
    cfg = load_with_overrides(args)
    if args.emit_serve_config:
        import yaml

        from kvmesh.cluster.app import serve_config_document

        text = yaml.safe_dump(serve_config_document(cfg), sort_keys=False)
        if args.emit_serve_config == "-":
            sys.stdout.write(text)
        else:
            with open(args.emit_serve_config, "w") as f:
                f.write(text)
            print(f"wrote {args.emit_serve_config} (deploy it with: serve deploy "
                  f"{args.emit_serve_config})", file=sys.stderr)
        return 0
    from kvmesh.cluster.launcher import DeployError, serve_forever

    try:
        return serve_forever(cfg, args.address)
    except DeployError as e:  # one line with the reason, not Serve's traceback
        print(f"kvmesh serve: the deployment failed: {e}", file=sys.stderr)
        return 1


def run_client(args) -> int:
    """Stream one answer to stdout; a refusal (HTTP status or gRPC code) is one line on stderr
    with the server's message, exit status 1."""
    import json
    import urllib.error

    import grpc

    try:
        return _stream_client(args)
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        print(f"kvmesh client: HTTP {e.code}: {message}", file=sys.stderr)
    except urllib.error.URLError as e:
        print(f"kvmesh client: cannot reach {args.url}: {e.reason}", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"kvmesh client: gRPC {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def _thinking(text: str | None) -> bool:
    """A reasoning model's thinking (server.reasoning_parser) goes to stderr as it streams, so
    stdout holds the answer alone; whether some did (a line end follows it)."""
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()
    return bool(text)


def _stream_client(args) -> int:
    from kvmesh.cluster.client import grpc_stream, http_stream

    import os

    api_key = args.api_key or os.environ.get("KVMESH_API_KEY")
    messages = None if args.raw else [{"role": "user", "content": args.prompt}]
    prompt = args.prompt if args.raw else None
    finish, usage, thought = None, None, False
    if args.grpc:
        for msg in grpc_stream(args.target, prompt=prompt, messages=messages,
                               max_tokens=args.max_tokens, temperature=args.temperature,
                               seed=args.seed, api_key=api_key):
            thought |= _thinking(msg.reasoning)
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            if msg.finish_reason:
                finish, usage = msg.finish_reason, msg.usage
                usage = {"prompt_tokens": usage.prompt_tokens,
                         "completion_tokens": usage.completion_tokens,
                         "cached_tokens": usage.cached_tokens}
    else:
        for chunk in http_stream(args.url, prompt=prompt, messages=messages,
                                 max_tokens=args.max_tokens, temperature=args.temperature,
                                 seed=args.seed, api_key=api_key):
            for choice in chunk.get("choices", []):
                thought |= _thinking(choice.get("delta", {}).get("reasoning"))
                text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                sys.stdout.write(text or "")
                sys.stdout.flush()
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                u = chunk["usage"]
                usage = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                         "cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)}
    print()
    if thought:
        print(file=sys.stderr)
    print(f"[finish_reason={finish} usage={usage}]", file=sys.stderr)
    return 0 if finish != "error" else 1


def run_status(args) -> int:
    """A table of the cluster's worker replicas: health, running and waiting requests, KV usage,
    prefix hit rate."""
    import json

    from kvmesh.cluster.status import format_table

    status = _status_from_ray(args) if args.address else _status_from_http(args)
    if args.json:
        print(json.dumps(status))
    else:
        print(f"model: {status['model']}  status: {status['status']}  healthy workers: "
              f"{sum(r['healthy'] for r in status['workers'])}/{len(status['workers'])}")
        for name, states in status.get("deployments", {}).items():
            print(f"deployment {name}: " + ", ".join(f"{k.lower()} {v}" for k, v in sorted(states.items())))
        print(format_table(status["workers"]))
    return 0 if status["status"] == "ok" else 1


def _status_from_http(args) -> dict:
    import json
    import os
    import urllib.error
    import urllib.request

    base = args.url.rstrip("/")
    api_key = args.api_key or os.environ.get("KVMESH_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def get(path):
        try:
            with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise ValueError(f"{base}{path}: 401 unauthorized (give --api-key or set KVMESH_API_KEY)") from None
            return json.load(e)
        except OSError as e:
            raise ValueError(f"cannot reach {base}: {e}") from None

    health = get("/health")
    workers = get("/v1/kvmesh/workers")
    if "error" in workers:  # e.g. a 503 while the KV event hub does not answer
        raise ValueError(f"{base}/v1/kvmesh/workers: {workers['error']['message']}")
    return {"model": workers.get("model"), "status": health.get("status", "error"),
            "workers": workers.get("workers", [])}


def _status_from_ray(args) -> dict:
    import ray
    from ray import serve

    from kvmesh.cluster.event_hub import NAMESPACE, hub_name
    from kvmesh.cluster.status import worker_rows

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        try:
            hub = ray.get_actor(hub_name(args.app_name), namespace=NAMESPACE)
        except ValueError:
            raise ValueError(f"no kvmesh application {args.app_name!r} on the Ray cluster at "
                             f"{args.address} (its KV event hub actor is missing)") from None
        loads, stats = ray.get(hub.loads.remote(), timeout=30)
        app = serve.status().applications.get(args.app_name)
        deployments = {}
        if app is not None:
            deployments = {name: {str(k): v for k, v in d.replica_states.items()}
                           for name, d in app.deployments.items()}
        rows = worker_rows(loads, stats)
        healthy = app is not None and str(app.status).endswith("RUNNING") and any(r["healthy"] for r in rows)
        return {"model": None, "status": "ok" if healthy else "degraded", "workers": rows,
                "deployments": deployments}
    finally:
        ray.shutdown()

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvmesh")
    register(parser.add_subparsers(dest="command"))
    a = parser.parse_args()
    sys.exit(a.handler(a))
