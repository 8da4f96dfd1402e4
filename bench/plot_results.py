#!/usr/bin/env python3
"""Plots a benchmark JSON (bench_sdpa.py's records) as TOPS against N, one panel per
(head dim, causal), one line per implementation. Usage: plot_results.py IN.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    records = json.load(open(sys.argv[1]))
    dims = sorted({r["d"] for r in records})
    fig, axes = plt.subplots(len(dims), 2, figsize=(11, 4 * len(dims)), squeeze=False)
    for row, d in enumerate(dims):
        for col, causal in enumerate((False, True)):
            ax = axes[row][col]
            # Kernel-only records (whole_call false) get their own, dashed line.
            for impl, whole in sorted({(r["impl"], r.get("whole_call", True)) for r in records},
                                      key=lambda x: (x[0], not x[1])):
                pts = sorted((r["n"], r["tops"]) for r in records
                             if r["impl"] == impl and r.get("whole_call", True) == whole
                             and r["d"] == d and r["causal"] == causal)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            linestyle="-" if whole else "--",
                            label=impl if whole else f"{impl} (kernel only)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length N (batch = 32K / N, 32 heads)")
            ax.set_ylabel("TOPS (whole call unless marked kernel only)")
            ax.set_title(f"d = {d}, {'causal' if causal else 'non-causal'}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    device = records[0].get("device", "")
    fig.suptitle(f"sagekit vs torch SDPA on {device}, fp16 inputs")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=90)


if __name__ == "__main__":
    main()
