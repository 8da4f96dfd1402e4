#!/usr/bin/env python3
"""Side-by-side benchmark: sagekit against torch SDPA (flash and cuDNN backends), one run.

Follows the protocol of docs/performance.md: whole call as a user makes it,
median of CUDA-event timings after warm-up, grid d in {64, 128} x causal x N in {1K..32K},
32 heads, batch = 32K / N. Each tensor is 32K tokens x 32 heads x d x 2 bytes (>= 134 MB),
far beyond the 50 MB L2, so consecutive calls cannot hit in cache; two input sets are still
alternated. Also records accuracy against float64 attention on a slice of the same inputs.

Besides the whole call, sagekit is also timed kernel-only: K/V of each input set are
quantized once (sagekit.quantize_kv) and only the attention kernel runs in the timed loop
(sagekit.sageattn_quantized_kv, which gives the same output bit for bit). Those are extra
records of impl "sagekit" with whole_call false; the difference to the whole-call time is
the K/V pre-pass. --no-kernel-only skips them.

Writes a JSON list of records (impl, recipe, d, causal, n, batch, heads, dtype, whole_call,
ms, tops, device) and a Markdown table.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import median_ms
from records import markdown_table



def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--dv", type=int, default=0,
                    help="V's head dim where it differs from Q/K's (MLA: --dims 192 --dv 128); 0: the same")
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--recipe", default="sage2_8b")
    ap.add_argument("--heads", type=int, default=32,
                    help="heads per call; 0: 4096 // d, the heads x d ~ 4096 of issue 34's head-dim grid")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kernel-only", action=argparse.BooleanOptionalAction, default=True,
                    help="also time sagekit's attention kernel alone on K/V quantized once")
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    ap.add_argument("--recipes", default=None, metavar="all|NAME[,NAME..]",
                    help="instead of the side-by-side run: sagekit alone, whole call, for each of these "
                         "presets (all: every preset) on the grid above; records of impl sagekit named by "
                         "recipe, refusals recorded (bench/bench_recipes.py)")
    args = ap.parse_args()
    if args.recipes:
        from bench_recipes import run_recipes  # bench/, the script's own folder
        return run_recipes(args, median_ms)

    import sagekit

    dev = torch.cuda.get_device_name()
    records = []
    grid = [(dt, d, c, n) for dt in args.dtypes.split(",") for d in map(int, args.dims.split(","))
            for c in map(int, args.causal.split(",")) for n in map(int, args.ns.split(","))]
    t_start = time.time()
    for idx, (dt, d, causal, n) in enumerate(grid):
        dtype = getattr(torch, dt)
        batch = max(1, args.tokens // n)
        heads = args.heads or max(1, 4096 // d)
        dv = args.dv or d
        sets = [[torch.randn(batch, heads, n, dim, device="cuda", dtype=dtype) for dim in (d, d, dv)]
                for _ in range(2)]
        # QK^T over d and PV over dv (4 n^2 d when they are equal).
        ops = 2.0 * batch * heads * n * n * (d + dv) / (2 if causal else 1)
        impls = {
            "sagekit": lambda i=0: sagekit.sageattn(*sets[i % 2], is_causal=bool(causal), recipe=args.recipe),
        }
        # Kernel-only: K/V of both input sets quantized once, outside the timed calls.
        kernel_only, kvs = None, []
        if args.kernel_only:
            try:
                kvs = [sagekit.quantize_kv(k, v, recipe=args.recipe) for _, k, v in sets]
                kernel_only = lambda i=0: sagekit.sageattn_quantized_kv(  # noqa: E731
                    sets[i % 2][0], kvs[i % 2], is_causal=bool(causal))
            except Exception as e:  # an older package without the two-step API, say
                print(f"  sagekit kernel-only: failed: {e}", file=sys.stderr)
        for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(i=0, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*sets[i % 2], is_causal=bool(causal))
            impls[name] = run
        row = {}
        # (impl, whole_call, label in the progress line, function)
        timed = [(name, True, name, fn) for name, fn in impls.items()]
        if kernel_only is not None:
            timed.insert(1, ("sagekit", False, "sagekit-kernel", kernel_only))
        for name, whole_call, label, fn in timed:
            try:
                ms = median_ms(fn, args.warmup, args.iters)
            except Exception as e:  # a backend that refuses the shape is reported, not hidden
                print(f"  {label}: failed: {e}", file=sys.stderr)
                continue
            tops = ops / (ms * 1e-3) / 1e12
            row[label] = tops
            records.append(dict(impl=name, recipe=args.recipe if name == "sagekit" else "fp16" if dt == "float16" else "bf16",
                                d=d, causal=bool(causal), n=n, batch=batch, heads=heads, dtype=dt,
                                whole_call=whole_call, ms=ms, tops=tops, device=dev,
                                **({"d_v": dv} if dv != d else {})))
        # accuracy of sagekit on one head of these inputs, against float64
        q, k, v = (t[:1, :1] for t in sets[0])
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=bool(causal))
        out = sagekit.sageattn(q, k, v, is_causal=bool(causal), recipe=args.recipe).double()
        cos = F.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
        l1 = ((out - ref).abs().sum() / ref.abs().sum()).item()
        for r in records:
            if r["impl"] == "sagekit" and (r["dtype"], r["d"], r["causal"], r["n"]) == (dt, d, bool(causal), n):
                r["cosine"], r["rel_l1"] = cos, l1
        del sets, kvs, kernel_only
        torch.cuda.empty_cache()
        ratio = row.get("sagekit", float("nan")) / row.get("torch-cudnn", float("nan"))
        print(f"[{idx + 1}/{len(grid)}] {dt} d={d}{f' dv={dv}' if dv != d else ''} causal={causal} n={n}: "
              + "  ".join(f"{k} {v:7.1f}" for k, v in row.items())
              + f"  sage/cudnn {ratio:.2f}  cos {cos:.5f}  ({time.time() - t_start:.0f}s)", flush=True)

    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    lines = markdown_table(records, dev, args.iters, args.recipe)
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
