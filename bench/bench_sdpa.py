#!/usr/bin/env python3
"""Side-by-side benchmark: sagekit against torch SDPA (flash and cuDNN backends), one run.

Follows the protocol of docs/performance.md (DESIGN.md's): whole call as a user makes it,
median of CUDA-event timings after warm-up, grid d in {64, 128} x causal x N in {1K..32K},
32 heads, batch = 32K / N. Each tensor is 32K tokens x 32 heads x d x 2 bytes (>= 134 MB),
far beyond the 50 MB L2, so consecutive calls cannot hit in cache; two input sets are still
alternated. Also records accuracy against float64 attention on a slice of the same inputs.

Writes a JSON list of records (impl, recipe, d, causal, n, batch, heads, dtype, whole_call,
ms, tops, device) and a Markdown table.
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--recipe", default="sage2_8b")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()

    import sagekit

    dev = torch.cuda.get_device_name()
    records = []
    grid = [(dt, d, c, n) for dt in args.dtypes.split(",") for d in map(int, args.dims.split(","))
            for c in map(int, args.causal.split(",")) for n in map(int, args.ns.split(","))]
    t_start = time.time()
    for idx, (dt, d, causal, n) in enumerate(grid):
        dtype = getattr(torch, dt)
        batch = max(1, args.tokens // n)
        sets = [[torch.randn(batch, args.heads, n, d, device="cuda", dtype=dtype) for _ in range(3)]
                for _ in range(2)]
        ops = 4.0 * batch * args.heads * n * n * d / (2 if causal else 1)
        impls = {
            "sagekit": lambda i=0: sagekit.sageattn(*sets[i % 2], is_causal=bool(causal), recipe=args.recipe),
        }
        for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(i=0, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*sets[i % 2], is_causal=bool(causal))
            impls[name] = run
        row = {}
        for name, fn in impls.items():
            try:
                ms = median_ms(fn, args.warmup, args.iters)
            except Exception as e:  # a backend that refuses the shape is reported, not hidden
                print(f"  {name}: failed: {e}", file=sys.stderr)
                continue
            tops = ops / (ms * 1e-3) / 1e12
            row[name] = tops
            records.append(dict(impl=name, recipe=args.recipe if name == "sagekit" else "fp16" if dt == "float16" else "bf16",
                                d=d, causal=bool(causal), n=n, batch=batch, heads=args.heads, dtype=dt,
                                whole_call=True, ms=ms, tops=tops, device=dev))
        # accuracy of sagekit on one head of these inputs, against float64
        q, k, v = (t[:1, :1] for t in sets[0])
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=bool(causal))
        out = sagekit.sageattn(q, k, v, is_causal=bool(causal), recipe=args.recipe).double()
        cos = F.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
        l1 = ((out - ref).abs().sum() / ref.abs().sum()).item()
        for r in records:
            if r["impl"] == "sagekit" and (r["dtype"], r["d"], r["causal"], r["n"]) == (dt, d, bool(causal), n):
                r["cosine"], r["rel_l1"] = cos, l1
        del sets
        torch.cuda.empty_cache()
        ratio = row.get("sagekit", float("nan")) / row.get("torch-cudnn", float("nan"))
        print(f"[{idx + 1}/{len(grid)}] {dt} d={d} causal={causal} n={n}: "
              + "  ".join(f"{k} {v:7.1f}" for k, v in row.items())
              + f"  sage/cudnn {ratio:.2f}  cos {cos:.5f}  ({time.time() - t_start:.0f}s)", flush=True)

    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    # Markdown: one row per grid point, TOPS of each implementation and the ratios.
    lines = [f"Whole-call TOPS on {dev} (median of {args.iters} CUDA-event timings; recipe {args.recipe}).", "",
             "| dtype | d | causal | N | sagekit | torch-flash | torch-cudnn | vs flash | vs cuDNN |",
             "|---|---|---|---|---|---|---|---|---|"]
    keyed = {}
    for r in records:
        keyed.setdefault((r["dtype"], r["d"], r["causal"], r["n"]), {})[r["impl"]] = r["tops"]
    for (dt, d, c, n), row in keyed.items():
        s, fl, cu = row.get("sagekit", math.nan), row.get("torch-flash", math.nan), row.get("torch-cudnn", math.nan)
        lines.append(f"| {dt} | {d} | {'yes' if c else 'no'} | {n} | {s:.0f} | {fl:.0f} | {cu:.0f} | {s / fl:.2f} | {s / cu:.2f} |")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
