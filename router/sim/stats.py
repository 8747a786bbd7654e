"""A policy judged over several seeds: mean and 95% t-interval of each metric, and the paired
difference to a reference policy (by seed: the same trace under both, so the trace's own variance
cancels and the interval is much tighter than two separate intervals compared).

Seed specs (`kvmesh sim --seeds`): a range "0-9", a list "0,3,5", a mix "0-2,7", or a count "10"
(seeds 0..9).
"""

import math

# Two-sided 95% Student t quantiles t_{0.975, df} for df = 1..30; past 30 the Cornish-Fisher
# expansion below is within 1e-4 (no scipy in the serving image).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def interval(values) -> dict:
    """{"mean", "lo", "hi", "n"}: the 95% t-interval of the mean; one value gives lo = hi = mean."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def parse_seeds(spec: str) -> list[int]:
    """"0-9" -> 0..9, "0,3,5" -> [0, 3, 5], "10" -> 0..9 (a count); parts combine: "0-2,7"."""
    spec = spec.strip()
    if spec.isdigit():
        count = int(spec)
        if count < 1:
            raise ValueError(f"--seeds: a count must be >= 1, got {spec!r}")
        return list(range(count))
    seeds: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"--seeds wants a count (10), a range (0-9) or a list (0,3,5); got {spec!r}")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"--seeds: range {part.strip()!r} runs backwards")
        seeds.extend(range(lo, hi + 1))
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: {spec!r} names a seed twice")
    return seeds


def summarize_seeds(per_seed: list[dict], metrics) -> dict:
    """{policy: {metric: interval}} over the seeds' `run` reports."""
    policies = per_seed[0]["policies"]
    return {p: {m: interval(r["policies"][p][m] for r in per_seed) for m in metrics} for p in policies}


def paired_differences(per_seed: list[dict], metrics, reference: str = "kv_events") -> dict:
    """{policy: {metric: interval of (policy - reference) by seed}} for every other policy; {} when
    the reference was not run."""
    policies = per_seed[0]["policies"]
    if reference not in policies:
        return {}
    return {p: {m: interval(r["policies"][p][m] - r["policies"][reference][m] for r in per_seed)
                for m in metrics}
            for p in policies if p != reference}
