"""Memory and engine work for streams nobody reads (the figures of docs/RELIABILITY.md "Backpressure").

    python bench/unread_streams.py --streams 120 --idle-timeout-s 0   # no idle timeout
    python bench/unread_streams.py --streams 120 --idle-timeout-s 3

Starts `kvmesh serve` (one CPU worker, random:tiny-llama), opens N streaming chat requests over raw
sockets on 127.0.0.1 whose clients read the response head and then nothing, and prints every 5 s
for --observe-s the resident memory of Serve's proxy, the ingress and the worker, and the worker's
running requests and generated tokens; then closes the clients and prints once more.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
from reliability_support import chat_stream_body, http, open_raw_stream, ray_processes, rss_mb  # noqa: E402

from kvmesh.cluster.local import LocalCluster  # noqa: E402

MODEL = "random:tiny-llama"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=120)
    parser.add_argument("--idle-timeout-s", type=float, default=3.0, help="server.stream_idle_timeout_s (0 = none)")
    parser.add_argument("--observe-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=1900)
    args = parser.parse_args()
    config = {"model": MODEL, "engine": {"device": "cpu", "max_num_seqs": max(64, args.streams)},
              "replicas": {"num_replicas": 1, "num_gpus": 0, "num_cpus": 1,
                           "max_ongoing_requests": max(64, args.streams)},
              "server": {"stream_idle_timeout_s": args.idle_timeout_s}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    with LocalCluster([], config=f.name) as cluster:
        started = time.monotonic()

        def report(what: str) -> None:
            (row,) = http(cluster.http_url + "/v1/kvmesh/workers")[1]["workers"]
            mb = {role: rss_mb(ray_processes(cluster, role)) for role in ("ProxyActor", "Ingress", "KVWorker")}
            print(f"{time.monotonic() - started:6.1f} s  {what:<16} proxy {mb['ProxyActor']:6.1f} MB  "
                  f"ingress {mb['Ingress']:6.1f} MB  worker {mb['KVWorker']:6.1f} MB  "
                  f"running {row['running']:3d}  kv_used {row['kv_used']:.3f}  tokens {row['tokens_out']}",
                  flush=True)

        report("idle")
        clients = [open_raw_stream(cluster.http_port, "/v1/chat/completions",
                                   chat_stream_body(MODEL, args.max_tokens), rcvbuf=4096)[0]
                   for _ in range(args.streams)]
        report(f"{args.streams} opened")
        deadline = time.monotonic() + args.observe_s
        while time.monotonic() < deadline:
            time.sleep(5)
            report("unread")
        for client in clients:
            client.close()
        time.sleep(5)
        report("clients closed")


if __name__ == "__main__":
    main()
