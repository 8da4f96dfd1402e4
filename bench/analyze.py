#!/usr/bin/env python3
"""Per grid point: the floors a whole call of sage2_8b cannot beat on this design, next to
the measurement. Usage: analyze.py RESULTS.json > table.md

Ceilings (the project's probes on an H100): 8-bit wgmma 1940 TOPS; MUFU ex2
16/SM/clock at 1.83 GHz on 132 SMs; device copy 3.0 TB/s (bytes read + written).
Bytes of the current design, per element of a [B, H, N, d] tensor (Hq = Hkv):
  Q read 2; K and V read twice by the pre-pass (statistics, then quantization) 8;
  INT8 K + FP8 V written 2 and read back by the attention kernel at least once 2;
  O written 2  -> 16 bytes.
"""
import json
import sys

MMA_TOPS = 1940e12
EXP_PER_S = 16 * 132 * 1.83e9
COPY_BPS = 3.0e12
BYTES_PER_ELEMENT = 16


def main():
    # Whole calls only: the floors above count the pre-pass, which kernel-only records skip.
    recs = [r for r in json.load(open(sys.argv[1]))
            if r["impl"] == "sagekit" and r.get("whole_call", True)]
    cudnn = {(r["d"], r["causal"], r["n"]): r["tops"] for r in json.load(open(sys.argv[1]))
             if r["impl"] == "torch-cudnn"}
    print("| d | causal | N | measured TOPS | ms | MMA floor ms | exp floor ms | memory floor ms "
          "| limiter | measured / floor | vs cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(recs, key=lambda r: (r["d"], r["causal"], r["n"])):
        b, h, n, d = r["batch"], r["heads"], r["n"], r["d"]
        frac = 0.5 if r["causal"] else 1.0
        ops = 4.0 * b * h * n * n * d * frac
        mma = ops / MMA_TOPS * 1e3
        exp = b * h * n * n * frac / EXP_PER_S * 1e3
        mem = BYTES_PER_ELEMENT * b * h * n * d / COPY_BPS * 1e3
        floors = {"MMA": mma, "exp": exp, "memory": mem}
        limiter = max(floors, key=floors.get)
        print(f"| {d} | {'yes' if r['causal'] else 'no'} | {n} | {r['tops']:.0f} | {r['ms']:.3f} | "
              f"{mma:.3f} | {exp:.3f} | {mem:.3f} | {limiter} | {r['ms'] / floors[limiter]:.1f}x | "
              f"{r['tops'] / cudnn.get((d, r['causal'], n), float('nan')):.2f} |")


if __name__ == "__main__":
    main()
