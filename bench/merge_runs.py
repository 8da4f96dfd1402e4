#!/usr/bin/env python3
"""One grid from several runs of bench_sdpa.py (the same grid each time): per point and
implementation the median of the runs' medians, with each run's ms kept as runs_ms.
A single run of the grid moves by several percent between runs of the same code
(docs/performance.md), so where a grid was run several times their median is the record.

Usage: merge_runs.py --iters I --json OUT.json --markdown OUT.md RUN1.json RUN2.json [...]
(I: the --iters the runs were taken with; the records do not carry it).
"""
import argparse
import json

from records import markdown_table, median_of_runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, required=True, help="bench_sdpa.py's --iters of the runs")
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    ap.add_argument("runs", nargs="+", help="bench_sdpa.py JSON files of the same grid")
    args = ap.parse_args()
    if len(args.runs) < 2:
        ap.error("give at least two runs (one run is its own record)")
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    merged = median_of_runs(runs)
    with open(args.json, "w") as f:
        json.dump(merged, f, indent=1)
    lines = markdown_table(merged, merged[0].get("device", "?"), args.iters,
                           merged[0].get("recipe", "?"), runs=len(runs))
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
