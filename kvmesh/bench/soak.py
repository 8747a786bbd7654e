"""`kvmesh bench soak`: a bounded run of mixed streaming / non-streaming / aborted requests against a
cluster, with memory sampled throughout; it fails (exit 1) when a request is lost or memory grows
beyond a bound.

    kvmesh bench soak --launch "--replicas 2 --device cpu --model random:tiny-llama" --duration-s 600
    kvmesh bench soak --url http://127.0.0.1:8000 --duration-s 600 --api-key KEY

Memory, sampled every --sample-every-s:
- from /metrics (any cluster): the ingress's resident memory (kvmesh_ingress_rss_bytes) and its
  router copy's KV index size (kvmesh_router_index_blocks);
- with --launch (the cluster runs below this process): the resident memory of every Ray process of
  the cluster by role (Ingress, KVWorker, KVEventHub), read with psutil.
Growth is judged after a warm-up (--warmup-fraction of the run: caches, allocator pools and the
prefix cache fill first): the mean of the last fifth of the samples minus the mean of the first
fifth after warm-up must stay under --max-growth-mb per process, and the index must stay within
the workers' KV pools (it can only hold blocks some worker holds).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import threading
import time
import urllib.request

DEFAULT_MIX = "whole=0.4,stream=0.4,abort=0.2"


def add_arguments(p) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running cluster's HTTP API (http://host:port)")
    where.add_argument("--launch", metavar="ARGS",
                       help="start `kvmesh serve ARGS` here for the run (quoted), and stop it after")
    p.add_argument("--model", default=None, help="model name to request (default: the served one)")
    p.add_argument("--duration-s", type=float, default=600.0, help="how long to send requests")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"request kinds and weights ({DEFAULT_MIX})")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--timeout-s", type=float, default=60.0, help="deadline of one request (a hang beyond it fails the run)")
    p.add_argument("--sample-every-s", type=float, default=2.0, help="memory sampling interval")
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="share of the run ignored by the growth check")
    p.add_argument("--max-growth-mb", type=float, default=50.0, help="allowed memory growth per process after warm-up")
    p.add_argument("--api-key", default=None, help="bearer token to send")
    p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")
    p.add_argument("--seed", type=int, default=0)


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in ("whole", "stream", "abort") or not weight:
            raise ValueError(f"--mix: {part!r} is not kind=weight with kind whole, stream or abort")
        mix[name.strip()] = float(weight)
    return mix


def scrape(base_url: str, api_key: str | None = None, headers: dict | None = None,
           timeout_s: float = 10.0) -> dict[str, float]:
    """GET /metrics: {sample name with labels: value}."""
    headers = dict(headers or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    with urllib.request.urlopen(urllib.request.Request(base_url + "/metrics", headers=headers),
                                timeout=timeout_s) as r:
        return parse_prometheus(r.read().decode())


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name with labels: value} (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def cluster_processes(root_pid: int) -> dict[str, list]:
    """The cluster's Ray processes below root_pid, by role."""
    import psutil

    roles: dict[str, list] = {"Ingress": [], "KVWorker": [], "KVEventHub": []}
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for role in roles:
            if title.startswith("ray::") and role in title:
                roles[role].append(p)
    return roles


class Sampler:
    """Samples memory on its own thread until stopped."""

    def __init__(self, base_url: str, api_key: str | None, every_s: float, root_pid: int | None):
        self.base_url, self.api_key, self.every_s, self.root_pid = base_url, api_key, every_s, root_pid
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start_time = time.monotonic()

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.every_s)

    def sample(self) -> dict:
        s: dict = {"t": time.monotonic() - self.start_time}
        try:
            m = scrape(self.base_url, self.api_key)
            s["ingress_rss_mb"] = m.get("kvmesh_ingress_rss_bytes", 0.0) / 2**20
            s["router_index_blocks"] = m.get("kvmesh_router_index_blocks", 0.0)
            s["kv_total_blocks"] = _kv_pool_blocks(m)
        except OSError as e:
            s["scrape_error"] = str(e)
        if self.root_pid is not None:
            import psutil

            for role, procs in cluster_processes(self.root_pid).items():
                for i, p in enumerate(sorted(procs, key=lambda p: p.pid)):
                    try:
                        s[f"{role}[{i}]_rss_mb"] = p.memory_info().rss / 2**20
                    except psutil.Error:
                        pass
        return s


def _kv_pool_blocks(m: dict[str, float]) -> float:
    """All workers' KV blocks: free / (1 - usage) per worker."""
    def by_worker(name):
        return {re.search(r'worker="([^"]+)"', k).group(1): v for k, v in m.items()
                if k.startswith(name + "{")}
    free, usage = by_worker("kvmesh_kv_free_blocks"), by_worker("kvmesh_kv_usage_ratio")
    return sum(f / (1 - usage[w]) for w, f in free.items() if w in usage and usage[w] < 1)


def growth(samples: list[dict], key: str, warmup_fraction: float) -> float | None:
    """Mean of the last fifth minus mean of the first fifth of the post-warm-up samples."""
    values = [s[key] for s in samples if key in s]
    values = values[int(len(values) * warmup_fraction):]
    if len(values) < 5:
        return None
    k = max(1, len(values) // 5)
    return sum(values[-k:]) / k - sum(values[:k]) / k


def judge(samples: list[dict], summary: dict, max_growth_mb: float, warmup_fraction: float) -> dict:
    keys = sorted({k for s in samples for k in s if k.endswith("_rss_mb")})
    growths = {k: growth(samples, k, warmup_fraction) for k in keys}
    over = {k: g for k, g in growths.items() if g is not None and g > max_growth_mb}
    index_peak = max((s.get("router_index_blocks", 0.0) for s in samples), default=0.0)
    pool = max((s.get("kv_total_blocks") or 0.0 for s in samples), default=0.0)
    problems = []
    if summary["lost"]:
        problems.append(f"{summary['lost']} requests lost (failed or hung)")
    if over:
        problems.append("memory grew beyond " + f"{max_growth_mb} MB: " +
                        ", ".join(f"{k} +{g:.1f} MB" for k, g in over.items()))
    if pool and index_peak > pool + 1:
        problems.append(f"router index holds {index_peak:.0f} blocks, more than the KV pools' {pool:.0f}")
    return {"growth_mb": growths, "router_index_peak_blocks": index_peak,
            "kv_pool_blocks": pool, "problems": problems, "ok": not problems}


def run(args) -> int:
    from kvmesh.bench.traffic import Traffic, summarize

    mix = parse_mix(args.mix)
    cluster = None
    if args.launch:
        from kvmesh.cluster.local import LocalCluster

        cluster = LocalCluster(shlex.split(args.launch)).start()
        base_url, root_pid = cluster.http_url, cluster.proc.pid
    else:
        base_url, root_pid = args.url.rstrip("/"), None
    try:
        model = args.model or _served_model(base_url, args.api_key)
        traffic = Traffic(base_url, model, api_key=args.api_key, timeout_s=args.timeout_s,
                          max_tokens=args.max_tokens, seed=args.seed)
        sampler = Sampler(base_url, args.api_key, args.sample_every_s, root_pid).start()
        started = time.monotonic()
        outcomes = traffic.run_for(args.duration_s, args.concurrency, mix)
        elapsed = time.monotonic() - started
        sampler.stop()
        sampler.samples.append(sampler.sample())
    finally:
        if cluster is not None:
            cluster.stop()
    summary = summarize(outcomes)
    verdict = judge(sampler.samples, summary, args.max_growth_mb, args.warmup_fraction)
    result = {"duration_s": elapsed, "concurrency": args.concurrency, "mix": mix,
              "max_tokens": args.max_tokens, **summary, **verdict,
              "requests_per_s": summary["requests"] / elapsed if elapsed else 0.0,
              "latency_p50_s": _percentile([o.latency_s for o in outcomes if o.result == "ok"], 50),
              "latency_p99_s": _percentile([o.latency_s for o in outcomes if o.result == "ok"], 99),
              "samples": sampler.samples}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    _print(result)
    return 0 if verdict["ok"] else 1


def _served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(base_url + "/v1/models", headers=headers),
                                timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def _print(r: dict, out=sys.stdout) -> None:
    print(f"soak: {r['requests']} requests in {r['duration_s']:.0f} s "
          f"({r['requests_per_s']:.1f}/s, concurrency {r['concurrency']}), lost {r['lost']}, "
          f"retried {r['retried']}", file=out)
    print("  " + ", ".join(f"{k} {n}" for k, n in r["by_kind_result"].items()), file=out)
    for key, g in r["growth_mb"].items():
        first = next((s[key] for s in r["samples"] if key in s), None)
        last = next((s[key] for s in reversed(r["samples"]) if key in s), None)
        label = re.sub(r"_rss_mb$", "", key)
        g_text = "n/a" if g is None else f"{g:+.1f} MB"
        print(f"  memory {label}: {first:.0f} -> {last:.0f} MB, growth after warm-up {g_text}", file=out)
    print(f"  router index: peak {r['router_index_peak_blocks']:.0f} blocks "
          f"(KV pools {r['kv_pool_blocks']:.0f})", file=out)
    print("  PASS" if r["ok"] else "  FAIL: " + "; ".join(r["problems"]), file=out)
