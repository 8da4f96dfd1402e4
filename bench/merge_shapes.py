#!/usr/bin/env python3
"""Issue 34's record: the head-dim grid (bench_sdpa.py records, dense) and the packed batch
(bench_varlen.py records) in one file, each record with `kind`, `d_v` and `window`.
Usage: merge_shapes.py OUT.json [DIMS.json] [VARLEN.json] (missing inputs are skipped)."""
import json
import os
import sys


def main(out, *inputs):
    records = []
    for path in inputs:
        if not os.path.exists(path):
            print(f"merge_shapes.py: {path} missing, skipped", file=sys.stderr)
            continue
        for r in json.load(open(path)):
            r.setdefault("kind", "dense")
            r.setdefault("d_v", r["d"])
            r.setdefault("window", [-1, -1])
            records.append(r)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {out} ({len(records)} records)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:])
