#!/usr/bin/env python3
"""Summarizes a same-run A/B of `sage bench` tables (scripts/gpu_run.sh, stage `ab`).

Input: the stage's ab.txt, blocks headed "-- old (round k)" / "-- new (round k)", each a
`sage bench` table. For every point (dtype, d, causal, N) it takes each side's median TOPS over
the rounds and prints the new/old ratio, their geomean and the lowest ratio, as Markdown.
"""
import math
import re
import statistics
import sys
from collections import defaultdict


def parse(lines):
    tops = defaultdict(lambda: defaultdict(list))  # side -> point -> [TOPS per round]
    side = None
    for line in lines:
        head = re.match(r"^-- (\S+) .*\(round \d+\)", line)
        if head:
            side = head.group(1)
            continue
        cols = line.split()
        # recipe dtype d causal N batch copies ms TOPS ...
        if side and len(cols) >= 9 and cols[2].isdigit() and cols[4].isdigit():
            point = (cols[1], int(cols[2]), cols[3], int(cols[4]))
            tops[side][point].append(float(cols[8]))
    return tops


def summarize(tops):
    old, new = tops.get("old", {}), tops.get("new", {})
    rows, ratios = [], []
    for point in sorted(set(old) & set(new)):
        a, b = statistics.median(old[point]), statistics.median(new[point])
        ratios.append(b / a)
        rows.append((point, a, b, b / a))
    return rows, ratios


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "-"
    lines = sys.stdin.readlines() if path == "-" else open(path).read().splitlines()
    rows, ratios = summarize(parse(lines))
    if not ratios:
        print("ab_compare: no point was timed on both sides")
        return 1
    print("| dtype | d | causal | N | old TOPS | new TOPS | new/old |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for (dtype, d, causal, n), a, b, r in rows:
        print(f"| {dtype} | {d} | {causal} | {n} | {a:.1f} | {b:.1f} | {r:.3f} |")
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"\n{len(ratios)} points: geomean new/old {geomean:.3f}, lowest {min(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
