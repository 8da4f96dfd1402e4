#!/usr/bin/env python3
"""The scaling table and plot of bench/sequence_parallel.py's records (issue 37).

    python3 bench/sequence_parallel_report.py RECORDS.json [--plot OUT.png]

Prints a Markdown table: per dtype, N, engine mode and world size, sagekit's speed-up over
one GPU (a plain sagekit call in the same run) and its speed against the same engine
running torch SDPA's cuDNN kernel. The plot shows the speed-ups against N.
"""
import argparse
import json


def rows(records):
    single = {(r["dtype"], r["n"], r["impl"]): r["ms"] for r in records if r["mode"] == "single"}
    engine = {(r["dtype"], r["n"], r["impl"], r["mode"], r["ranks"]): r["ms"]
              for r in records if r["mode"] != "single"}
    for r in records:
        if r["mode"] == "single" or not r["impl"].endswith("-sagekit"):
            continue
        name = r["impl"][: -len("-sagekit")]
        cudnn = engine.get((r["dtype"], r["n"], f"{name}-cudnn", r["mode"], r["ranks"]))
        yield dict(dtype=r["dtype"], n=r["n"], engine=name, mode=r["mode"], ranks=r["ranks"],
                   ms=r["ms"], scaling=single[(r["dtype"], r["n"], "single-sagekit")] / r["ms"],
                   vs_cudnn=cudnn / r["ms"] if cudnn else None)


def markdown(records):
    out = ["| dtype | N | GPUs | engine | mode | ms | speed-up over 1 GPU | vs same engine on cuDNN |",
           "|---|---|---|---|---|---|---|---|"]
    for x in sorted(rows(records), key=lambda x: (x["dtype"], x["n"], x["ranks"], x["engine"], x["mode"])):
        vs = f"{x['vs_cudnn']:.2f}x" if x["vs_cudnn"] else "-"
        out.append(f"| {x['dtype']} | {x['n'] // 1024}K | {x['ranks']} | {x['engine']} | {x['mode']} | "
                   f"{x['ms']:.1f} | {x['scaling']:.2f}x | {vs} |")
    return "\n".join(out)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = list(rows(records))
    dtypes = sorted({x["dtype"] for x in data})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for key in sorted({(x["ranks"], x["engine"], x["mode"]) for x in data}):
            pts = sorted((x["n"], x["scaling"]) for x in data
                         if (x["ranks"], x["engine"], x["mode"]) == key and x["dtype"] == dtype)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if key[0] == 4 else "--", label=f"{key[0]} GPUs {key[1]} {key[2]}")
        for ranks, bar in ((2, 1.8), (4, 3.4)):
            ax.axhline(bar, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the sequence")
        ax.set_ylabel("speed-up over one GPU (sagekit)")
        ax.set_title(f"{dtype}: 24 heads, d 128, forward")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records")
    p.add_argument("--plot")
    args = p.parse_args()
    records = json.load(open(args.records))
    print(markdown(records))
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
