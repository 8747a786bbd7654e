"""Records what each engine step did (for the floor) and where its wall time went, by wrapping the
engine's step and its runner's execute on the instance (the engine itself is unchanged)."""

import time
from contextlib import nullcontext


class StepProbe:
    def __init__(self, engine, profile_step: int | None = None, profile_path: str | None = None):
        self.engine = engine
        self.steps: list[tuple[list[int], list[int], int]] = []  # (query_lens, seq_lens, num_sampled)
        self.step_seconds = 0.0
        self.execute_seconds = 0.0
        self.profile_step = profile_step
        self.profile_path = profile_path
        self.profile_table: str | None = None
        self._runner_execute = engine.runner.execute
        self._engine_step = engine.step
        engine.runner.execute = self._execute
        engine.step = self._step

    def detach(self) -> None:
        self.engine.runner.execute = self._runner_execute
        self.engine.step = self._engine_step

    def reset(self) -> None:
        self.steps.clear()
        self.step_seconds = self.execute_seconds = 0.0

    def _step(self):
        start = time.perf_counter()
        out = self._engine_step()
        self.step_seconds += time.perf_counter() - start
        return out

    def _execute(self, output, *args):
        scheduled = output.scheduled
        self.steps.append(([e.num_new_tokens for e in scheduled],
                           [e.request.num_computed_tokens + e.num_new_tokens for e in scheduled],
                           sum(1 for e in scheduled if e.samples)))
        profiling = self.profile_step is not None and len(self.steps) == self.profile_step
        ctx = _profiler() if profiling else nullcontext()
        start = time.perf_counter()
        with ctx as prof:
            result = self._runner_execute(output, *args)
        self.execute_seconds += time.perf_counter() - start
        if profiling:
            self.profile_table = _describe_profile(prof, scheduled)
            if self.profile_path:
                prof.export_chrome_trace(self.profile_path)
        return result


def _profiler():
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
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
