"""bench_sdpa.py's records without torch: the Markdown table of a grid, and one grid from
several runs of it (per point and implementation, the median of the runs' medians).

A record is a dict with the keys impl, recipe, d, causal, n, batch, heads, dtype, whole_call,
ms, tops, device (and for sagekit cosine, rel_l1).
"""
import math
import statistics


def _point(r):
    return (r["impl"], r.get("whole_call", True), r["dtype"], r["d"], r["causal"], r["n"])


def markdown_table(records, dev, iters, recipe, runs=1):
    """One row per grid point: TOPS of each implementation and the ratios of whole calls; the
    kernel-only column (records with whole_call false) shows what the K/V pre-pass costs."""
    timing = f"median of {iters} CUDA-event timings"
    if runs > 1:
        timing += f", then the median of {runs} runs of the grid"
    lines = [f"Whole-call TOPS on {dev} ({timing}; recipe {recipe}); "
             "sagekit kernel-only: the attention kernel alone, on K/V quantized once.", "",
             "| dtype | d | causal | N | sagekit | sagekit kernel-only | torch-flash | torch-cudnn | vs flash | vs cuDNN |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keyed = {}
    for r in records:
        impl = r["impl"] if r.get("whole_call", True) else r["impl"] + " kernel-only"
        keyed.setdefault((r["dtype"], r["d"], r["causal"], r["n"]), {})[impl] = r["tops"]
    for (dt, d, c, n), row in keyed.items():
        s, fl, cu = row.get("sagekit", math.nan), row.get("torch-flash", math.nan), row.get("torch-cudnn", math.nan)
        kern = row.get("sagekit kernel-only", math.nan)
        lines.append(f"| {dt} | {d} | {'yes' if c else 'no'} | {n} | {s:.0f} | {kern:.0f} | {fl:.0f} | {cu:.0f} | "
                     f"{s / fl:.2f} | {s / cu:.2f} |")
    return lines


def median_of_runs(runs):
    """runs: a list of record lists, each one whole run of the same grid. Returns the first
    run's records (same order and keys) with ms the median of the runs' ms, tops recomputed
    from it, and runs_ms the runs' own ms. A point missing from any run is an error: the
    median of fewer runs would look like the others."""
    if not runs:
        raise ValueError("median_of_runs: no runs given")
    by_point = []
    for i, run in enumerate(runs):
        points = {}
        for r in run:
            if _point(r) in points:
                raise ValueError(f"median_of_runs: run {i} has the point {_point(r)} twice")
            points[_point(r)] = r
        by_point.append(points)
    merged = []
    for r in runs[0]:
        key = _point(r)
        missing = [i for i, points in enumerate(by_point) if key not in points]
        if missing:
            raise ValueError(f"median_of_runs: the point {key} is missing from runs {missing}")
        ms = [points[key]["ms"] for points in by_point]
        m = dict(r)
        m["ms"] = statistics.median(ms)
        m["tops"] = r["tops"] * r["ms"] / m["ms"]  # the same operation count at every run
        m["runs_ms"] = ms
        merged.append(m)
    extra = [k for points in by_point[1:] for k in points if k not in by_point[0]]
    if extra:
        raise ValueError(f"median_of_runs: points {extra} are missing from run 0")
    return merged
