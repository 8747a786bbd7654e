"""Autoscaling on a bursty trace: a kvmesh policy against a fixed fleet sized for the peak.

The trace's arrivals alternate a quiet phase at `base_load` and a burst at the peak (`load` of
the fixed fleet's estimated capacity, capacity.py). Replicas are SimWorkers (the routing sim's
calibrated engine). Requests wait at the ingress while every ready replica holds
`max_ongoing_requests`, as Serve's handle queues them, and go to the ready replica with the fewest
outstanding. Every `tick_s` the autoscaler samples what a cluster's workers report (free KV
fraction, running / waiting requests, end-to-end TTFT p90 and ITL p90 over `window_s`) and what
the handles count, averages each over the window as Serve's `mean` aggregation does, and calls the
configured kvmesh policy through Serve's own wrapper (serve_policy.py): the decision code of a
cluster. A replica it adds serves after `startup_s` (model load) and is billed from the decision;
one it removes takes no new requests and is billed until its last request ends.

TTFT counts from arrival at the ingress; SLO attainment is the fraction of requests whose TTFT is
at most `ttft_p90_target_s`. Replica-hours are the billed time of every replica.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from ray.serve.config import AutoscalingConfig

from kvmesh.cluster.autoscaling import (ITL_P90, KV_FREE_RATIO, RUNNING, TTFT_P90, WAITING,
                                        build_policy, serve_autoscaling_config)
from kvmesh.cluster.slo_window import p90
from kvmesh.router.sim.capacity import capacity_req_s
from kvmesh.cluster.serve_policy import ServePolicy
from kvmesh.router.sim.worker import Job, SimWorker
from kvmesh.router.sim.workloads import Workload
from kvmesh.serve_config import AutoscalingSection

_STEP, _READY, _ARRIVAL, _TICK = 0, 1, 2, 3  # at one instant: steps end, replicas start, then the rest


@dataclass(frozen=True)
class BurstProfile:
    """Arrivals in periods of `period_s`: a quiet phase at `base_load` of the peak rate, a ramp of
    `ramp_s` up to the peak rate, `burst_s` at the peak, a ramp of `ramp_s` down (Poisson at the
    rate of each moment). `ramp_s` 0: the rate steps from the base to the peak at once."""
    period_s: float = 600.0
    burst_s: float = 120.0
    base_load: float = 0.15
    ramp_s: float = 0.0

    def __post_init__(self):
        if not 0 < self.burst_s + 2 * self.ramp_s < self.period_s or self.ramp_s < 0:
            raise ValueError(f"burst_s + 2 x ramp_s must be in (0, period_s={self.period_s}), got "
                             f"burst_s {self.burst_s}, ramp_s {self.ramp_s}")
        if not 0 < self.base_load <= 1:
            raise ValueError(f"base_load must be in (0, 1], got {self.base_load}")

    def rate_shape(self, t: np.ndarray) -> np.ndarray:
        """The rate at times `t` within a period, as a fraction of the peak."""
        burst_start = self.period_s - self.burst_s - self.ramp_s
        distance = np.maximum(burst_start - t, t - (burst_start + self.burst_s))  # <= 0 in the burst
        rise = np.clip(1.0 - distance / self.ramp_s, 0.0, 1.0) if self.ramp_s else (distance <= 0) * 1.0
        return self.base_load + (1.0 - self.base_load) * rise

    def assign(self, workload: Workload, peak_rate: float) -> None:
        """Map each request's unit-rate Poisson offset through the inverse cumulative rate."""
        t = np.linspace(0.0, self.period_s, int(self.period_s * 100) + 1)
        rate = peak_rate * self.rate_shape(t)
        mass = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(t))])
        for r in workload.requests:
            period, rest = divmod(r.start_offset, mass[-1])
            r.arrival = float(period * self.period_s + np.interp(rest, mass, t))


@dataclass(frozen=True)
class AutoscaleSimConfig:
    autoscaling: AutoscalingSection
    startup_s: float = 30.0  # a new replica serves this long after the decision (model load)
    tick_s: float = 1.0  # how often the autoscaler decides (Serve: 0.1 s; 1 s keeps the sim fast)
    max_ongoing_requests: int = 256  # per replica; beyond it requests wait at the ingress

    def __post_init__(self):
        if self.startup_s < 0:
            raise ValueError(f"startup_s must be >= 0, got {self.startup_s}")
        if self.tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")


@dataclass
class _Replica:
    worker: SimWorker
    billed_from: float
    ready_at: float
    stopping: bool = False  # takes no new requests
    billed_until: float | None = None
    jobs: list[Job] = field(default_factory=list)  # the requests it holds
    done: deque = field(default_factory=deque)  # requests it finished, oldest first
    samples: deque = field(default_factory=deque)  # (time, its report)

    def accepts(self, now: float, limit: int) -> bool:
        return (self.billed_until is None and not self.stopping and self.ready_at <= now
                and self.worker.outstanding < limit)

    def report(self, now: float, window_s: float) -> dict[str, float]:
        """What cluster/worker.py record_autoscaling_stats reports, from the simulated worker."""
        while self.done and now - self.done[0].finish_time > window_s:
            self.done.popleft()
        started = [j for j in self.jobs if j.first_token_time is not None] + list(self.done)
        ttfts = [j.first_token_time - j.arrival for j in started if now - j.first_token_time <= window_s]
        ttfts += [now - j.arrival for j in self.jobs if j.first_token_time is None]
        itls = [(j.finish_time - j.first_token_time) / (j.request.output_len - 1)
                for j in self.done if j.request.output_len > 1]
        w = self.worker
        return {KV_FREE_RATIO: w.cache.num_free / w.cache.capacity, RUNNING: float(w.running),
                WAITING: float(len(w.waiting)), TTFT_P90: p90(ttfts), ITL_P90: p90(itls)}


class AutoscaleSim:
    """One run: a fixed fleet (`policy` None) or an autoscaled one."""

    def __init__(self, sim, config: AutoscaleSimConfig, fixed_replicas: int | None = None):
        self.sim, self.config = sim, config
        self.window_s = config.autoscaling.window_s
        self.replicas: list[_Replica] = []
        self.versions: list[int] = []
        self.ingress: deque[Job] = deque()
        self.heap: list = []
        self.order = 0
        self.target = 0
        self.handle_samples: deque = deque()  # (time, requests in the system, queued at the ingress)
        self.policy = None
        if fixed_replicas is None:
            a = config.autoscaling
            serve_config = serve_autoscaling_config(a, a.min_replicas)
            serve_config.pop("policy")
            self.policy = ServePolicy(build_policy(a), AutoscalingConfig(**serve_config))
        for _ in range(fixed_replicas if fixed_replicas is not None else config.autoscaling.min_replicas):
            self._start_replica(0.0, ready_at=0.0)

    # ---- the run -------------------------------------------------------------------------------

    def run(self, workload: Workload) -> dict:
        jobs = []
        for r in workload.requests:
            self._push(r.arrival, _ARRIVAL, r)
        if self.policy is not None:
            self._push(0.0, _TICK, None)
        remaining = len(workload.requests)
        now = 0.0
        while remaining:
            now, kind, _, payload = heapq.heappop(self.heap)
            if kind == _ARRIVAL:
                job = Job(request=payload, arrival=now)
                jobs.append(job)
                self.ingress.append(job)
            elif kind == _STEP:
                remaining -= self._step_end(*payload, now)
            elif kind == _TICK:
                self._decide(now)
                self._push(now + self.config.tick_s, _TICK, None)
            self._dispatch(now)
        for replica in self.replicas:
            if replica.billed_until is None:
                replica.billed_until = now
        return self._summary(jobs, now)

    def _push(self, when: float, kind: int, payload) -> None:
        heapq.heappush(self.heap, (when, kind, self.order, payload))
        self.order += 1

    def _start_replica(self, now: float, ready_at: float) -> None:
        i = len(self.replicas)
        worker = SimWorker(f"worker-{i}", self.sim.cost, self.sim.blocks_per_worker,
                           self.sim.max_batch, self.sim.max_batched_tokens)
        self.replicas.append(_Replica(worker, billed_from=now, ready_at=ready_at))
        self.versions.append(0)
        self.target += 1
        if ready_at > now:
            self._push(ready_at, _READY, i)

    def _dispatch(self, now: float) -> None:
        """Queued requests, oldest first, to the least-loaded ready replica with a free slot."""
        limit = self.config.max_ongoing_requests
        while self.ingress:
            open_slots = [i for i, r in enumerate(self.replicas) if r.accepts(now, limit)]
            if not open_slots:
                return
            i = min(open_slots, key=lambda k: self.replicas[k].worker.outstanding)
            job = self.ingress.popleft()
            self.replicas[i].jobs.append(job)
            self._reschedule(i, self.replicas[i].worker.submit(job, now))

    def _step_end(self, i: int, version: int, now: float) -> int:
        """Finish replica i's step; returns how many requests finished."""
        if version != self.versions[i]:
            return 0
        replica = self.replicas[i]
        _, finished, end = replica.worker.on_step_end(now)
        self._reschedule(i, end)
        if finished:
            gone = set(map(id, finished))
            replica.jobs = [j for j in replica.jobs if id(j) not in gone]
            replica.done.extend(finished)
        if replica.stopping and replica.worker.outstanding == 0:
            replica.billed_until = now
        return len(finished)

    def _reschedule(self, i: int, end: float | None) -> None:
        if end is not None:
            self.versions[i] += 1
            self._push(end, _STEP, (i, self.versions[i]))

    # ---- the autoscaler ------------------------------------------------------------------------

    def _decide(self, now: float) -> None:
        running = [r for r in self.replicas if r.billed_until is None and not r.stopping
                   and r.ready_at <= now]
        in_system = len(self.ingress) + sum(r.worker.outstanding for r in self.replicas
                                            if r.billed_until is None)
        self.handle_samples.append((now, in_system, len(self.ingress)))
        _trim(self.handle_samples, now, self.window_s)
        for replica in running:
            replica.samples.append((now, replica.report(now, self.window_s)))
            _trim(replica.samples, now, self.window_s)
        metrics = {name: [_mean(s[name] for _, s in r.samples) for r in running]
                   for name in (KV_FREE_RATIO, RUNNING, WAITING, TTFT_P90, ITL_P90)}
        desired = self.policy.decide(
            now, len(running), self.target, _mean(s[1] for s in self.handle_samples),
            _mean(s[2] for s in self.handle_samples), metrics)
        self._scale_to(desired, now)

    def _scale_to(self, desired: int, now: float) -> None:
        while self.target < desired:
            self._start_replica(now, ready_at=now + self.config.startup_s)
        # Serve stops replicas still starting first, then the least loaded running ones.
        stoppable = sorted((i for i, r in enumerate(self.replicas) if r.billed_until is None and not r.stopping),
                           key=lambda k: (self.replicas[k].ready_at <= now, self.replicas[k].worker.outstanding))
        for i in stoppable[:max(0, self.target - desired)]:
            replica = self.replicas[i]
            replica.stopping = True
            self.target -= 1
            if replica.ready_at > now or replica.worker.outstanding == 0:
                replica.billed_until = now

    # ---- the report ----------------------------------------------------------------------------

    def _summary(self, jobs: list[Job], end: float) -> dict:
        ttft = np.array([j.first_token_time - j.arrival for j in jobs])
        target = self.config.autoscaling.ttft_p90_target_s
        hours = sum(r.billed_until - r.billed_from for r in self.replicas) / 3600
        return {"requests": len(jobs), "ttft_p50_s": float(np.percentile(ttft, 50)),
                "ttft_p90_s": float(np.percentile(ttft, 90)), "ttft_p99_s": float(np.percentile(ttft, 99)),
                "slo_attainment": float(np.mean(ttft <= target)), "replica_hours": hours,
                "mean_replicas": hours * 3600 / end, "peak_replicas": self._peak_replicas(),
                "duration_s": end}

    def _peak_replicas(self) -> int:
        edges = sorted([(r.billed_from, 1) for r in self.replicas] + [(r.billed_until, -1) for r in self.replicas],
                       key=lambda e: (e[0], e[1]))
        peak = count = 0
        for _, step in edges:
            count += step
            peak = max(peak, count)
        return peak


def _trim(samples: deque, now: float, window_s: float) -> None:
    while samples and now - samples[0][0] > window_s:
        samples.popleft()


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def run_autoscale(workload: Workload, sim, config: AutoscaleSimConfig, profile: BurstProfile,
                  peak_rate: float, fixed_replicas: int) -> dict:
    """The same bursty trace on a fixed fleet of `fixed_replicas` and on the autoscaled fleet."""
    profile.assign(workload, peak_rate)
    fixed = AutoscaleSim(sim, config, fixed_replicas=fixed_replicas).run(workload)
    scaled = AutoscaleSim(sim, config).run(workload)
    a = config.autoscaling
    return {"fixed": fixed, "autoscaled": scaled,
            "config": {"policy": a.policy, "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
                       "fixed_replicas": fixed_replicas, "peak_rate_req_s": peak_rate,
                       "ttft_p90_target_s": a.ttft_p90_target_s, "startup_s": config.startup_s,
                       "period_s": profile.period_s, "burst_s": profile.burst_s,
                       "base_load": profile.base_load, "ramp_s": profile.ramp_s,
                       "requests": len(workload.requests)}}


def format_autoscale_table(report: dict) -> str:
    c = report["config"]
    lines = [f"policy {c['policy']} ({c['min_replicas']}-{c['max_replicas']} replicas, startup "
             f"{c['startup_s']:g} s) vs a fixed fleet of {c['fixed_replicas']}; peak "
             f"{c['peak_rate_req_s']:.1f} req/s, {c['burst_s']:g} s bursts (ramps {c['ramp_s']:g} s) every "
             f"{c['period_s']:g} s at base {c['base_load']:g}; {c['requests']} requests; TTFT target {c['ttft_p90_target_s']:g} s",
             f"{'fleet':<12}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'SLO met':>9}{'replica-h':>11}"
             f"{'mean':>7}{'peak':>6}"]
    for name in ("fixed", "autoscaled"):
        r = report[name]
        lines.append(f"{name:<12}{r['ttft_p50_s']:>10.3f}{r['ttft_p90_s']:>9.3f}{r['ttft_p99_s']:>9.3f}"
                     f"{r['slo_attainment']:>9.1%}{r['replica_hours']:>11.3f}{r['mean_replicas']:>7.2f}"
                     f"{r['peak_replicas']:>6d}")
    return "\n".join(lines)


_SIM_OPTIONS = {"startup_s", "tick_s", "max_ongoing_requests"}
_PROFILE_OPTIONS = {"period_s", "burst_s", "base_load", "ramp_s"}


def run_from_options(workload: Workload, policy: str, sim, load: float | None, rate: float | None,
                     options: dict) -> dict:
    """`kvmesh sim --autoscale POLICY`: the peak is `rate` req/s or `load` x the estimated capacity
    of `sim.num_workers` replicas (the fixed fleet, and max_replicas unless an option sets it);
    `options` set AutoscalingSection fields, AutoscaleSimConfig fields and BurstProfile fields."""
    unknown = set(options) - _SIM_OPTIONS - _PROFILE_OPTIONS - set(AutoscalingSection.model_fields)
    if unknown:
        raise ValueError(f"unknown --autoscale-opt {', '.join(sorted(unknown))}")
    section = {"enabled": True, "policy": policy, "min_replicas": 0, "max_replicas": sim.num_workers,
               **{k: v for k, v in options.items() if k in AutoscalingSection.model_fields}}
    config = AutoscaleSimConfig(AutoscalingSection(**section),
                                **{k: v for k, v in options.items() if k in _SIM_OPTIONS})
    profile = BurstProfile(**{k: v for k, v in options.items() if k in _PROFILE_OPTIONS})
    peak = rate if rate is not None else load * capacity_req_s(workload, sim.cost, sim.num_workers, sim.max_batch)
    return run_autoscale(workload, sim, config, profile, peak, fixed_replicas=sim.num_workers)
