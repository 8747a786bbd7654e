"""`kvmesh bench serve`: an open-loop HTTP benchmark of a kvmesh cluster.

Requests come from the router simulator's seeded workloads (kvmesh.router.sim.workloads, `tenants`
by default: tenants with shared system prompts, Zipf popularity), sent as token ids to
/v1/completions with streaming, at Poisson arrivals of `--rate` requests/s (open loop: a slow server
does not slow the client down) or with `--concurrency` requests always in flight (closed loop).
Each request asks for exactly its output length (ignore_eos). Reported: TTFT, TPOT and ITL p50 /
p99, output throughput, and the prefix hit rate (cached / prompt tokens, from the usage).

Importing this module costs only argparse (the CLI may register `add_arguments` at start-up).
Against a running cluster (`--url`), or `--launch "ARGS"` to start `kvmesh serve ARGS` once per
policy in `--policies` and compare them on the same trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of a running cluster")
    parser.add_argument("--launch", metavar="ARGS", help='start `kvmesh serve ARGS` per policy (e.g. "--replicas 2 --device cpu --model random:tiny-llama")')
    parser.add_argument("--policies", default="kv_events,round_robin", help="with --launch: routing policies to compare")
    parser.add_argument("--workload", default="tenants", help="simulator workload (tenants, multiturn, prefix_repetition, random)")
    parser.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="workload parameter as in `kvmesh sim`, e.g. system_tokens=512; repeatable")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, nargs="+", default=None, metavar="RATE",
                        help="Poisson arrivals per second (open loop); several rates sweep them in "
                             "order on one cluster per policy")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (closed loop)")
    parser.add_argument("--num-tenants", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this (default: the served model's)")
    parser.add_argument("--urgent-share", type=float, default=0.0, metavar="F",
                        help="send this share of the requests (a seeded draw) as urgent, with "
                             "--urgent-priority, and report TTFT and TPOT per class (a cluster under "
                             "engine.scheduling_policy priority runs them first)")
    parser.add_argument("--urgent-priority", type=int, default=-1, metavar="P",
                        help="the urgent requests' `priority` (default -1; 0 gives fcfs's baseline of "
                             "the same classes)")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent (and not measured) before the run")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--cpu-split", action="store_true",
                        help="with --launch: CPU time per request and per streamed chunk of each cluster process (needs psutil)")
    parser.add_argument("--json", dest="json_out", help="write the results as JSON here")
    parser.add_argument("--direct-http-port", type=int, default=None, metavar="PORT",
                        help="with --launch: serve also on the ingress replicas' own HTTP port "
                             "(server.direct_http_port) and send the requests there, not through "
                             "Serve's proxy")
    parser.add_argument("--sample-s", type=float, default=0.0, metavar="S",
                        help="every S seconds of a run, record each worker's running and waiting "
                             "requests and its step time over the interval (JSON 'samples'; a summary "
                             "line per worker)")
    parser.add_argument("--plot", metavar="PNG", help="with several --rate values: TTFT p99 and "
                        "throughput against the offered rate, one line per policy")


def build_trace(args, rate: float | None = None, block_size: int = 16):
    """The seeded workload; with `rate`, Poisson arrivals at that many requests per second."""
    from kvmesh.commands.sim import parse_workload_options
    from kvmesh.router.sim.workloads import assign_arrivals, make_workload

    options = {}
    if args.workload == "tenants":
        options = dict(num_tenants=args.num_tenants, system_tokens=args.system_tokens,
                       suffix_tokens=tuple(args.suffix_tokens), output_tokens=tuple(args.output_tokens))
    options.update(parse_workload_options(args.workload_opt))
    try:
        workload = make_workload(args.workload, args.num_requests, seed=args.seed,
                                 block_size=block_size, **options)
    except TypeError as e:  # an unknown --workload-opt key
        raise ValueError(f"workload {args.workload}: {e}") from None
    if rate:
        assign_arrivals(workload, rate)  # follow-up turns: sent after their previous answer
    return workload


async def _one(session, url: str, model: str, prompt: list[int], max_tokens: int, sent: float,
               session_key: str | None, priority: int | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if session_key:
        body["user"] = session_key
    if priority:
        body["priority"] = priority
    times, usage, status = [], None, 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        status = resp.status
        if status != 200:
            return _failed(status, (await resp.text())[:500], sent)
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    end = time.perf_counter()
    return {"status": status, "sent": sent, "end": end, "token_times": times, "usage": usage}


def _failed(status: int, error: str, sent: float) -> dict:
    """A request that produced no stream (an HTTP error, or 0 when the connection failed)."""
    return {"status": status, "error": error, "sent": sent, "end": time.perf_counter(),
            "token_times": [], "usage": None}


async def run_trace(url: str, workload, args, vocab_size: int, model: str) -> dict:
    results, duration = await send_trace(url, workload, args, vocab_size, model)
    return summarize(results, duration)


async def send_trace(url: str, workload, args, vocab_size: int, model: str) -> tuple[list[dict], float]:
    """Send the trace. A conversation's follow-up turn (multiturn) is sent its think time after the
    previous turn's answer has ended, as a user would, in both loop shapes; other requests go at
    their arrival (open loop) or as soon as a slot frees (closed loop; ready follow-ups first)."""
    import aiohttp

    reqs = workload.requests
    if not reqs:
        raise ValueError("--num-requests must be at least 1")
    prompts = {r.request_id: [int(t) % vocab_size for t in r.prompt_token_ids] for r in reqs}
    followups: dict[int, list] = {}
    for r in reqs:
        if r.after is not None:
            followups.setdefault(r.after, []).append(r)
    first_turns = [r for r in reqs if r.after is None]
    urgent = urgent_requests(reqs, getattr(args, "urgent_share", 0.0), args.seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for r in first_turns[: args.warmup]:
            await _one(session, url, model, prompts[r.request_id][:32], 2, time.perf_counter(), None)
        start = time.perf_counter()
        results: list[dict] = []
        all_done = asyncio.Event()
        ready: asyncio.Queue = asyncio.Queue()  # closed loop: follow-ups whose think time is over

        async def send(r) -> None:
            sent = time.perf_counter()
            try:
                result = await _one(session, url, model, prompts[r.request_id], r.output_len, sent,
                                    r.session_key, args.urgent_priority if r.request_id in urgent else None)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # counted as not ok, run goes on
                result = _failed(0, repr(e), sent)
            result["request_id"], result["after"] = r.request_id, r.after
            result["urgent"] = r.request_id in urgent
            results.append(result)
            for child in followups.get(r.request_id, ()):
                asyncio.get_running_loop().call_later(child.think_time_s, release, child)
            if len(results) == len(reqs):
                all_done.set()

        def release(child) -> None:
            if args.concurrency:
                ready.put_nowait(child)
            else:
                tasks.append(asyncio.create_task(send(child)))

        tasks: list[asyncio.Task] = []
        if args.concurrency:
            new = list(reversed(first_turns))

            async def user() -> None:
                while not all_done.is_set():
                    if not ready.empty() or not new:
                        getter = asyncio.ensure_future(ready.get())
                        finished = asyncio.ensure_future(all_done.wait())
                        await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
                        finished.cancel()
                        if not getter.done():
                            getter.cancel()
                            return
                        await send(getter.result())
                    else:
                        await send(new.pop())
            await asyncio.gather(*(user() for _ in range(args.concurrency)))
        else:
            for r in first_turns:
                delay = start + r.arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(r)))
            await all_done.wait()
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def urgent_requests(requests, share: float, seed: int) -> set:
    """The request ids sent as urgent: each with probability `share`, a draw seeded by `seed`."""
    import random

    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--urgent-share must be in [0, 1], got {share}")
    draw = random.Random(f"urgent-{seed}")
    return {r.request_id for r in requests if draw.random() < share}


def _pct(values, q):
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else float("nan")


def _generated(r: dict) -> int:
    return r["usage"]["completion_tokens"] if r["usage"] else len(r["token_times"])


def _latencies(ok: list[dict]) -> tuple[list[float], list[float]]:
    """TTFT and TPOT of each request. A chunk may carry several tokens (a worker coalesces what
    piled up), so TPOT divides by the tokens after the first one, from the usage, not by the chunks."""
    ttft = [r["token_times"][0] - r["sent"] for r in ok]
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / (_generated(r) - 1)
            for r in ok if _generated(r) > 1 and len(r["token_times"]) > 1]
    return ttft, tpot


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["token_times"]]
    ttft, tpot = _latencies(ok)
    itl = [b - a for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok if r["usage"])
    output = sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])
    classes = {}
    if any(r.get("urgent") for r in results):  # --urgent-share: each class's latencies apart
        for name, urgent in (("urgent", True), ("normal", False)):
            c_ttft, c_tpot = _latencies([r for r in ok if bool(r.get("urgent")) == urgent])
            classes[name] = {"requests": sum(bool(r.get("urgent")) == urgent for r in results),
                             "ok": len(c_ttft), "ttft_p50_s": _pct(c_ttft, 50), "ttft_p99_s": _pct(c_ttft, 99),
                             "tpot_p50_s": _pct(c_tpot, 50), "tpot_p99_s": _pct(c_tpot, 99)}
    summary = {
        "requests": len(results), "ok": len(ok), "duration_s": duration,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
        "chunks": sum(len(r["token_times"]) for r in ok),
        "output_tokens_per_s": output / duration if duration else 0.0,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
    }
    if classes:
        summary["classes"] = classes
    return summary


def served_model(url: str) -> tuple[str, int | None]:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=60) as resp:
        model = json.load(resp)["data"][0]
    return model["id"], model.get("vocab_size")


def bench_url(url: str, args, rate: float | None = None) -> dict:
    """One run of the trace against `url`: open loop at `rate` requests/s, else closed loop."""
    model, vocab = served_model(url)
    vocab = args.vocab_size or vocab or 151936
    workload = build_trace(args, rate)
    before = _workers(url)
    result = asyncio.run(_run_sampled(url, workload, args, vocab, model))
    result["workers"] = _worker_deltas(before, _workers(url))
    return result


async def _run_sampled(url: str, workload, args, vocab_size: int, model: str) -> dict:
    """run_trace, with the workers sampled every args.sample_s seconds beside it (when > 0)."""
    if args.sample_s <= 0:
        return await run_trace(url, workload, args, vocab_size, model)
    samples, stop = [], asyncio.Event()

    async def sample():
        t0 = time.perf_counter()
        while not stop.is_set():
            rows = await asyncio.to_thread(_workers, url)
            samples.append({"t": round(time.perf_counter() - t0, 3), "workers": {
                w: {k: r.get(k, 0) for k in ("running", "waiting", "kv_used", "steps", "step_seconds")}
                for w, r in rows.items()}})
            try:
                await asyncio.wait_for(stop.wait(), args.sample_s)
            except asyncio.TimeoutError:
                pass

    sampler = asyncio.create_task(sample())
    try:
        result = await run_trace(url, workload, args, vocab_size, model)
    finally:
        stop.set()
        await sampler
    result["samples"] = samples
    result["sampled"] = sample_summary(samples)
    return result


def sample_summary(samples: list[dict]) -> dict[str, dict]:
    """Per worker over the samples: running p50 / mean / max, waiting max, the mean engine step of
    each interval between two samples (p50 / max), and the share of the sampled span spent inside
    Engine.step: how a worker's load and speed moved during the run, and how much of it it stepped."""
    import numpy as np

    out = {}
    for w in sorted({w for s in samples for w in s["workers"]}):
        seen = [s["workers"][w] for s in samples if w in s["workers"]]
        steps = [1e3 * (b["step_seconds"] - a["step_seconds"]) / (b["steps"] - a["steps"])
                 for a, b in zip(seen, seen[1:]) if b["steps"] > a["steps"]]
        running = [x["running"] for x in seen]
        times = [s["t"] for s in samples if w in s["workers"]]
        span_s = times[-1] - times[0]
        stepped_s = seen[-1]["step_seconds"] - seen[0]["step_seconds"]
        out[w] = {"running_p50": float(np.median(running)) if running else 0.0,
                  "running_mean": float(np.mean(running)) if running else 0.0,
                  "running_max": max(running, default=0),
                  "stepping_share": stepped_s / span_s if span_s > 0 else 0.0,
                  "waiting_max": max((x["waiting"] for x in seen), default=0),
                  "step_ms_p50": float(np.median(steps)) if steps else 0.0,
                  "step_ms_max": max(steps, default=0.0)}
    return out


def _workers(url: str) -> dict[str, dict]:
    """The cluster's per-worker counters (GET /v1/kvmesh/workers), or {} where it has none."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/kvmesh/workers", timeout=30) as resp:
            return {w["worker"]: w for w in json.load(resp)["workers"]}
    except (OSError, ValueError, KeyError):
        return {}


def _worker_deltas(before: dict, after: dict) -> dict[str, dict]:
    """Requests and output tokens each worker served during the run, and its mean step time during
    it (from the raw step counters; a cluster that does not report them gives its mean since start)."""
    out = {}
    for worker_id, a in after.items():
        b = before.get(worker_id, {})
        steps = a.get("steps", 0) - b.get("steps", 0)
        step_ms = (1e3 * (a["step_seconds"] - b.get("step_seconds", 0.0)) / steps if steps > 0
                   else a.get("step_ms", 0.0))
        out[worker_id] = {"requests": a.get("requests", 0) - b.get("requests", 0),
                          "tokens_out": a.get("tokens_out", 0) - b.get("tokens_out", 0),
                          "preempted": a.get("preempted", 0) - b.get("preempted", 0),
                          "step_ms": step_ms, "hit_rate": a.get("hit_rate", 0.0)}
    return out


# Which part of the cluster a process is, from its command line (Ray titles its workers
# "ray::<actor class>" or "ray::ServeReplica:<app>:<deployment>").
ROLES = (("ProxyActor", "proxy"), (":Ingress", "ingress"), (":KVWorker", "worker actor"),
         ("kvmesh.cluster.engine_process", "engine"), ("KVEventHub", "kv event hub"),
         ("ServeController", "serve controller"), ("raylet", "ray"), ("gcs_server", "ray"))


def role_of(cmdline: str) -> str | None:
    for marker, role in ROLES:
        if marker in cmdline:
            return role
    return None


class CpuSplit:
    """CPU time (user + system) of each process under a `kvmesh serve` process, by role, from now
    until `per_request`: where a cluster on this machine spends its CPU per request and per chunk."""

    def __init__(self, root_pid: int):
        try:
            import psutil
        except ImportError:
            raise ValueError("--cpu-split needs psutil (pip install psutil)") from None
        root = psutil.Process(root_pid)
        self.procs = [(role_of(" ".join(p.cmdline())), p) for p in root.children(recursive=True)]
        self.procs = [(role, p) for role, p in self.procs if role]
        self.start = self._cpu()

    def _cpu(self) -> dict[str, float]:
        import psutil

        total: dict[str, float] = {}
        for role, p in self.procs:
            try:
                t = p.cpu_times()
            except psutil.Error:  # gone (a replaced replica): its time is lost
                continue
            total[role] = total.get(role, 0.0) + t.user + t.system
        return total

    def per_request(self, result: dict) -> dict[str, dict]:
        used = {role: t - self.start.get(role, 0.0) for role, t in self._cpu().items()}
        n, chunks = max(1, result["ok"]), max(1, result["chunks"])
        return {role: {"cpu_s": cpu_s, "ms_per_request": 1e3 * cpu_s / n, "us_per_chunk": 1e6 * cpu_s / chunks}
                for role, cpu_s in sorted(used.items(), key=lambda item: -item[1])}


def plot_sweep(rows: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, thr) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows.values()):
        pts = sorted((r for r in rows.values() if r["policy"] == policy), key=lambda r: r["rate"])
        ttft.plot([r["rate"] for r in pts], [r["ttft_p99_s"] * 1e3 for r in pts], marker="o", label=policy)
        thr.plot([r["rate"] for r in pts], [r["output_tokens_per_s"] for r in pts], marker="o", label=policy)
    ttft.set(xlabel="offered load (requests/s)", ylabel="TTFT p99 (ms)", yscale="log", title="TTFT p99")
    thr.set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="throughput")
    for ax in (ttft, thr):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def format_table(rows: dict[str, dict]) -> str:
    cols = [("ttft_p50_s", "TTFT p50", 1e3), ("ttft_p99_s", "TTFT p99", 1e3),
            ("tpot_p50_s", "TPOT p50", 1e3), ("tpot_p99_s", "TPOT p99", 1e3),
            ("itl_p50_s", "ITL p50", 1e3), ("itl_p99_s", "ITL p99", 1e3),
            ("output_tokens_per_s", "out tok/s", 1), ("prefix_hit_rate", "hit rate", 1)]
    head = "| policy | ok | " + " | ".join(c[1] + (" (ms)" if c[2] == 1e3 else "") for c in cols) + " |"
    sep = "|" + "---|" * (len(cols) + 2)
    lines = [head, sep]
    for name, r in rows.items():
        vals = [f"{r[k] * s:.1f}" if s == 1e3 else (f"{r[k]:.3f}" if k == "prefix_hit_rate" else f"{r[k]:.1f}")
                for k, _, s in cols]
        lines.append(f"| {name} | {r['ok']}/{r['requests']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def run(args) -> int:
    if not args.rate and not args.concurrency:
        raise ValueError("give --rate (open loop, requests/s) or --concurrency (closed loop)")
    if args.rate and min(args.rate) <= 0:
        raise ValueError(f"--rate must be > 0, got {min(args.rate)}")
    rates = args.rate or [None]
    urgent_requests([], args.urgent_share, args.seed)  # a share outside [0, 1] fails before any work
    if args.plot and len(rates) < 2:
        raise ValueError("--plot needs two or more --rate values (it draws against the offered rate)")
    rows = {}

    def measure(url: str, name: str, cluster_pid: int | None) -> None:
        for rate in rates:
            label = name if len(rates) == 1 else f"{name} @ {rate:g}/s"
            split = CpuSplit(cluster_pid) if args.cpu_split and cluster_pid else None
            rows[label] = bench_url(url, args, rate)
            rows[label].update(policy=name, rate=rate)
            if split:
                rows[label]["cpu_split"] = split.per_request(rows[label])

    if args.launch:
        from kvmesh.cluster.local import LocalCluster
        from kvmesh.router.policies import parse_policy_names

        for policy in parse_policy_names(args.policies):
            launch = shlex.split(args.launch) + ["--policy", policy]
            if args.direct_http_port:
                launch += ["--direct-http-port", str(args.direct_http_port)]
            with LocalCluster(launch) as cluster:
                url = (f"http://127.0.0.1:{args.direct_http_port}" if args.direct_http_port
                       else cluster.http_url)
                print(f"[{policy}] serving at {url}", file=sys.stderr)
                measure(url, policy, cluster.proc.pid)
    else:
        measure(args.url.rstrip("/"), "served", None)
    print(format_table(rows))
    if args.plot:
        plot_sweep(rows, args.plot)
        print(f"plot: {args.plot}")
    for name, r in rows.items():
        if "cpu_split" in r:
            print(f"  {name} CPU per request / per streamed chunk: " + ", ".join(
                f"{role} {v['ms_per_request']:.2f} ms / {v['us_per_chunk']:.0f} us"
                for role, v in r["cpu_split"].items()))
    for name, r in rows.items():
        if "classes" in r:
            print(f"  {name} by class: " + "; ".join(
                f"{c} {v['ok']}/{v['requests']}: TTFT p50 {v['ttft_p50_s'] * 1e3:.1f} / p99 "
                f"{v['ttft_p99_s'] * 1e3:.1f} ms, TPOT p50 {v['tpot_p50_s'] * 1e3:.1f} ms"
                for c, v in r["classes"].items()))
    for name, r in rows.items():
        per_worker = ", ".join(f"{w}: {v['requests']} req, {v['preempted']} preempted, step {v['step_ms']:.1f} ms"
                               for w, v in sorted(r.get("workers", {}).items()))
        if per_worker:
            print(f"  {name} workers: {per_worker}")
        sampled = ", ".join(f"{w}: running {v['running_p50']:.0f}/{v['running_max']}, waiting max "
                            f"{v['waiting_max']}, step {v['step_ms_p50']:.1f}/{v['step_ms_max']:.1f} ms, "
                            f"stepping {v['stepping_share']:.0%} of the span"
                            for w, v in r.get("sampled", {}).items())
        if sampled:
            print(f"  {name} sampled (p50/max): {sampled}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "handler"},
                       "results": rows}, f, indent=2, default=str)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run(parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv))


if __name__ == "__main__":
    sys.exit(main())
