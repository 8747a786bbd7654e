"""Records what each engine step did (for the floor) and where its wall time went, by wrapping the
engine's step and its runner's execute on the instance (the engine itself is unchanged)."""

import time
from contextlib import nullcontext


class StepProbe:
    def __init__(self, engine, profile_step: int | None = None, profile_path: str | None = None,
                 profile_window: tuple[int, int] | None = None, step_times: bool = False):
        self.engine = engine
        # with step_times, each execute's span on the device: CUDA events on its stream (a GPU runs
        # steps in the order they were queued, so the span is the step's own), host clocks on a CPU
        self.step_times = step_times
        self._marks: list[tuple] = []
        self.steps: list[tuple[list[int], list[int], int]] = []  # (query_lens, seq_lens, num_sampled)
        self.step_seconds = 0.0
        self.execute_seconds = 0.0
        self.profile_step = profile_step
        self.profile_path = profile_path
        self.profile_table: str | None = None
        self.profile_window = profile_window
        self.window: dict | None = None  # what the GPU did over profile_window's steps
        self._window_profiler = None
        self._window_start, self._window_first = 0.0, 0
        self._runner_execute = engine.runner.execute
        self._engine_step = engine.step
        engine.runner.execute = self._execute
        engine.step = self._step

    def detach(self) -> None:
        self.engine.runner.execute = self._runner_execute
        self.engine.step = self._engine_step

    def reset(self) -> None:
        self.steps.clear()
        self._marks.clear()
        self.step_seconds = self.execute_seconds = 0.0

    def step_device_ms(self) -> list[float]:
        """Each recorded step's device time in ms (waits for the device)."""
        sync(self.engine.device)
        return [start.elapsed_time(end) if hasattr(start, "elapsed_time") else (end - start) * 1e3
                for start, end in self._marks]

    def _mark(self):
        if self.engine.device.type == "cuda":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _step(self):
        self._follow_window()
        start = time.perf_counter()
        out = self._engine_step()
        self.step_seconds += time.perf_counter() - start
        return out

    def _follow_window(self) -> None:
        """Profile the device's kernels (no host activity: the host loop runs at its own speed) from
        the window's first step to its last, then measure how busy the GPU was in that wall time.
        With profile_path, the host's activity too (slower, to see what the host did while the
        device waited), written there as a Chrome trace."""
        if self.profile_window is None or self.window is not None:
            return
        first, last = self.profile_window
        if self._window_profiler is None:
            if len(self.steps) >= first:
                self._window_profiler = _profiler(host=self.profile_path is not None)
                self._window_profiler.start()
                self._window_start, self._window_first = time.perf_counter(), len(self.steps)
        elif len(self.steps) >= last:
            self._close_window()

    def _close_window(self) -> None:
        sync(self.engine.device)
        wall = time.perf_counter() - self._window_start
        self._window_profiler.stop()
        self.window = gpu_busy(self._window_profiler, wall, len(self.steps) - self._window_first,
                               trace_path=self.profile_path)

    def finish(self) -> None:
        """Close a window the run ended inside."""
        if self._window_profiler is not None and self.window is None:
            self._close_window()

    def _execute(self, output, *args):
        scheduled = output.scheduled
        self.steps.append(([e.num_new_tokens for e in scheduled],
                           [e.request.num_computed_tokens + e.num_new_tokens for e in scheduled],
                           sum(1 for e in scheduled if e.samples)))
        profiling = self.profile_step is not None and len(self.steps) == self.profile_step
        ctx = _profiler() if profiling else nullcontext()
        start = time.perf_counter()
        mark = self._mark() if self.step_times else None
        with ctx as prof:
            result = self._runner_execute(output, *args)
        if mark is not None:
            self._marks.append((mark, self._mark()))
        self.execute_seconds += time.perf_counter() - start
        if profiling:
            self.profile_table = _describe_profile(prof, scheduled)
            if self.profile_path:
                prof.export_chrome_trace(self.profile_path)
        return result


def fit_decode_steps(steps: list[tuple[list[int], list[int], int]], device_ms: list[float]) -> dict:
    """Least squares over the decode-only steps (every sequence one new token): device ms = fixed +
    per sequence x batch + per KV token x context tokens read, refitted twice without the steps more
    than 3 robust deviations off (a step whose span includes a wait for the host). `fixed` is what a
    step costs whatever its batch (the weights, and the launches that do not grow with it); the rest
    grows with the work."""
    import numpy as np

    rows = [(len(q), sum(ctx), ms) for (q, ctx, _), ms in zip(steps, device_ms) if q and all(n == 1 for n in q)]
    decode_ms = sum(ms for _, _, ms in rows)
    out = {"decode_steps": len(rows), "decode_ms": decode_ms,
           "other_steps": len(device_ms) - len(rows), "other_ms": sum(device_ms) - decode_ms,
           # each step as [sequences, KV tokens read, device ms], for a fit of one's own
           "steps": [[len(q), sum(ctx), round(ms, 4)] for (q, ctx, _), ms in zip(steps, device_ms)]}
    if len(rows) < 4:
        return out
    a = np.array([[1.0, b, t] for b, t, _ in rows])
    y = np.array([ms for _, _, ms in rows])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):  # fit, then refit without the outliers (a step the host held up: its span waited)
        coef, *_ = np.linalg.lstsq(a[keep], y[keep], rcond=None)
        residual = y - a @ coef
        spread = 1.4826 * float(np.median(np.abs(residual[keep] - np.median(residual[keep]))))
        keep = np.abs(residual) <= max(3.0 * spread, 1e-9 * float(np.abs(y).max()))
    coef, *_ = np.linalg.lstsq(a[keep], y[keep], rcond=None)
    residual = y[keep] - a[keep] @ coef
    r2 = 1.0 - float(residual @ residual) / float(((y[keep] - y[keep].mean()) ** 2).sum() or 1.0)
    fixed = float(coef[0])
    return {**out, "fixed_ms": fixed, "per_seq_us": float(coef[1]) * 1e3, "per_kv_token_ns": float(coef[2]) * 1e6,
            "r2": r2, "fitted_steps": int(keep.sum()),
            "fixed_share_of_decode": fixed * len(rows) / decode_ms if decode_ms else 0.0}


def sync(device) -> None:
    """Wait for the device's queued work (a host clock read after it covers that work)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_busy(prof, wall_seconds: float, steps: int, trace_path: str | None = None) -> dict:
    """The union of the device's kernel and copy intervals in a profile, against the wall time it
    covered: near 1, the GPU bounds the run; well under 1, the host does. trace_path: keep the
    profile's Chrome trace there (else it goes to a temporary file)."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    spans, names, by_name, calls = [], [], {}, {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            spans.append((start, start + dur))
            name = e["name"][:80]  # template variants of one kernel share a name here
            names.append(name)
            by_name[name] = by_name.get(name, 0.0) + dur
            calls[name] = calls.get(name, 0) + 1
    busy_us = union_length(spans)
    gaps = idle_gaps(spans, names)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:24]
    tenths = []  # busy share of each tenth of the span from the first kernel to the last
    if spans:
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        width = (last - first) / 10 or 1.0
        for i in range(10):
            lo, hi = first + i * width, first + (i + 1) * width
            tenths.append(union_length([(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]) / width)
    return {"steps": steps, "wall_ms": wall_seconds * 1e3, "gpu_busy_ms": busy_us / 1e3,
            "gpu_busy_fraction": busy_us / 1e6 / wall_seconds if wall_seconds > 0 else 0.0,
            "gpu_busy_by_tenth": tenths,
            "kernels": len(spans), "kernel_ms_by_name": {name: us / 1e3 for name, us in top},
            "kernel_calls_by_name": {name: calls[name] for name, _ in top}, **gaps}


SHORT_GAP_US = 20.0  # an idle gap shorter than this is a launch's, not the host's


def idle_gaps(spans: list[tuple[float, float]], names: list[str]) -> dict:
    """The device's idle time between the first interval and the last, in microsecond spans: short gaps
    (under SHORT_GAP_US: the wait between one kernel's end and the next one's start, inside a graph or
    a queue) against long ones (the device waiting for the host), and the short gaps' time by the name
    of the kernel that ends them (what launched late). Long gaps are named too: by the kernel after
    them, by the kernel before them, and by tenth of the span (where in the run the host was late)."""
    short_us, long_us, short_count, before = 0.0, 0.0, 0, {}
    long_after, long_before, long_spans = {}, {}, []
    reach, previous = None, None
    for (start, end), name in sorted(zip(spans, names)):
        if reach is not None and start > reach:
            gap = start - reach
            if gap < SHORT_GAP_US:
                short_us, short_count = short_us + gap, short_count + 1
                before[name] = before.get(name, 0.0) + gap
            else:
                long_us += gap
                long_after[name] = long_after.get(name, 0.0) + gap
                long_before[previous] = long_before.get(previous, 0.0) + gap
                long_spans.append((reach, gap))
        if reach is None or end > reach:
            reach, previous = end, name

    def top(by: dict) -> dict:
        return {name: us / 1e3 for name, us in sorted(by.items(), key=lambda kv: -kv[1])[:12]}

    tenths = [0.0] * 10
    if long_spans:
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        width = (last - first) / 10 or 1.0
        for at, gap in long_spans:
            tenths[min(9, int((at - first) / width))] += gap / 1e3
    return {"short_gap_ms": short_us / 1e3, "short_gaps": short_count, "long_gap_ms": long_us / 1e3,
            "short_gap_ms_before": top(before), "long_gaps": len(long_spans),
            "long_gap_ms_before": top(long_after), "long_gap_ms_after": top(long_before),
            "long_gap_ms_by_tenth": tenths}


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (kernels overlapping on streams count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _profiler(host: bool = True):
    import torch

    # without a GPU a window profiles the host (its report then counts no device time)
    activities = [torch.profiler.ProfilerActivity.CPU] if host or not torch.cuda.is_available() else []
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _describe_profile(prof, scheduled) -> str:
    num_decodes = sum(1 for e in scheduled if e.num_new_tokens == 1)
    head = (f"one step: {len(scheduled)} sequences ({num_decodes} decodes), "
            f"{sum(e.num_new_tokens for e in scheduled)} tokens, "
            f"context {sum(e.request.num_computed_tokens + e.num_new_tokens for e in scheduled)} tokens\n")
    key = "self_cuda_time_total" if any(getattr(e, "device_type", None) is not None and
                                        str(e.device_type).endswith("CUDA") for e in prof.events()) else "self_cpu_time_total"
    try:
        return head + prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)
    except Exception as e:  # profiler tables differ across torch versions; the trace file stays
        return head + f"(no table: {e})"
