#!/usr/bin/env python3
"""SageBwd on the GPU (issue 33): speed of forward + backward against torch SDPA, and the
gradients' accuracy against float64 beside SDPA's in bf16.

    python3 bench/bench_backward.py --json backward.json [--accuracy-json acc.json]

Speed: the attention op alone as training calls it, whole call including every
quantization, bf16, d 64/128 x causal x N 1K-16K, 32 heads, 32K tokens per call; passes
"fwd" (out = attn(q, k, v)), "bwd" (torch.autograd.grad of a kept graph: for sagekit this
includes the forward its backward re-runs) and "fwd_bwd" (both, as a training step runs
them). Median of CUDA-event timings after warm-up, two input sets alternated. TOPS count
4 N^2 d per head for fwd, 2.5x that for bwd, 3.5x for fwd_bwd (halved when causal), the
FlashAttention convention. Records have bench_sdpa.py's keys plus "pass".

Accuracy (--accuracy-json): N = 4096, d = 128, one batch, 2 heads, bf16 inputs from a few of
the synthetic distributions (docs/numerics.md; drawn here with torch, not the library's
generator), dO ~ N(0, 1): cosine and relative L1 of dQ, dK, dV against float64 autograd,
for sagebwd and for SDPA in bf16 (its flash backend). The INT8-dP ablation has no GPU
kernel: `sage check --backward --dp-format int8` measures it on the CPU.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import median_ms



def attention_impls(causal: bool):
    import sagekit

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    return {"sagekit": lambda q, k, v: sagekit.sageattn(q, k, v, is_causal=causal, recipe="sagebwd"),
            "torch-flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "torch-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def speed(args):
    dev = torch.cuda.get_device_name()
    records = []
    grid = [(d, c, n) for d in map(int, args.dims.split(",")) for c in map(int, args.causal.split(","))
            for n in map(int, args.ns.split(","))]
    t0 = time.time()
    for idx, (d, causal, n) in enumerate(grid):
        batch = max(1, args.tokens // n)
        sets = [[torch.randn(batch, args.heads, n, d, device="cuda", dtype=torch.bfloat16,
                             requires_grad=True) for _ in range(3)] for _ in range(2)]
        douts = [torch.randn(batch, args.heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        fwd_ops = 4.0 * batch * args.heads * n * n * d / (2 if causal else 1)
        row = {}
        for name, attn in attention_impls(bool(causal)).items():
            kept = [attn(*s) for s in sets]   # graphs for the "bwd" pass

            def fwd(i):
                with torch.no_grad():
                    attn(*sets[i % 2])

            def bwd(i):
                torch.autograd.grad(kept[i % 2], sets[i % 2], douts[i % 2], retain_graph=True)

            def fwd_bwd(i):
                out = attn(*sets[i % 2])
                torch.autograd.grad(out, sets[i % 2], douts[i % 2])

            for pass_name, fn, factor in (("fwd", fwd, 1.0), ("bwd", bwd, 2.5), ("fwd_bwd", fwd_bwd, 3.5)):
                try:
                    ms = median_ms(fn, args.warmup, args.iters)
                except Exception as e:  # a backend that refuses the shape is reported, not hidden
                    print(f"  {name} {pass_name}: failed: {e}", file=sys.stderr)
                    continue
                tops = factor * fwd_ops / (ms * 1e-3) / 1e12
                row[f"{name} {pass_name}"] = tops
                records.append(dict(impl=name, recipe="sagebwd" if name == "sagekit" else "bf16",
                                    d=d, causal=bool(causal), n=n, batch=batch, heads=args.heads,
                                    dtype="bfloat16", whole_call=True, ms=ms, tops=tops, device=dev,
                                    **{"pass": pass_name}))
            del kept
        del sets, douts
        torch.cuda.empty_cache()
        s = row.get("sagekit fwd_bwd", float("nan"))
        print(f"[{idx + 1}/{len(grid)}] d={d} causal={causal} n={n}: fwd+bwd TOPS sagekit {s:.0f} "
              f"flash {row.get('torch-flash fwd_bwd', float('nan')):.0f} "
              f"cudnn {row.get('torch-cudnn fwd_bwd', float('nan')):.0f}  "
              f"vs flash {s / row.get('torch-flash fwd_bwd', float('nan')):.2f}x "
              f"vs cudnn {s / row.get('torch-cudnn fwd_bwd', float('nan')):.2f}x "
              f"({time.time() - t0:.0f}s)", flush=True)
    return records


def distribution(name: str, n: int, d: int, heads: int, gen: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(1, heads, n, d), randn(1, heads, n, d), randn(1, heads, n, d)
    if name == "k_bias":
        k = k + 5.0 * randn(1, heads, 1, d)
    elif name == "qk_bias":
        q, k = q + 2.0 * randn(1, heads, 1, d), k + 5.0 * randn(1, heads, 1, d)
    elif name == "v_bias":
        v = v + 5.0 * randn(1, heads, 1, d)
    elif name == "sharp":
        q, k = 3.0 * q, 3.0 * k
    elif name != "normal":
        raise ValueError(name)
    return q, k, v


def accuracy(args):
    import sagekit

    gen = torch.Generator().manual_seed(0)
    rows = []
    for dist in args.distributions.split(","):
        q64, k64, v64 = (x.cuda() for x in distribution(dist, args.acc_n, 128, 2, gen))
        do64 = torch.randn(q64.shape, generator=gen, dtype=torch.float64).cuda()
        # Every implementation sees the same bf16 values; the reference differentiates them in float64.
        q, k, v, do = (x.to(torch.bfloat16) for x in (q64, k64, v64, do64))
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        ref = torch.autograd.grad(F.scaled_dot_product_attention(*ref_in), ref_in, do.double())
        for name, fn in (("sagebwd", lambda a, b, c: sagekit.sageattn(a, b, c, recipe="sagebwd")),
                         ("torch-sdpa-bf16", lambda a, b, c: F.scaled_dot_product_attention(a, b, c))):
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            grads = torch.autograd.grad(fn(*inputs), inputs, do)
            row = dict(distribution=dist, impl=name, n=args.acc_n, d=128, dtype="bfloat16")
            for label, g, r in zip(("dq", "dk", "dv"), grads, ref):
                g = g.double()
                row[f"{label}_cosine"] = F.cosine_similarity(g.flatten(), r.flatten(), dim=0).item()
                row[f"{label}_rel_l1"] = ((g - r).abs().sum() / r.abs().sum()).item()
                row[f"{label}_nan"] = bool(torch.isnan(g).any())
            rows.append(row)
            print(f"{dist:8s} {name:16s} " + "  ".join(
                f"{x}: cos {row[x + '_cosine']:.6f} L1 {row[x + '_rel_l1']:.4f}" for x in ("dq", "dk", "dv")),
                flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="speed records (skipped when not given)")
    ap.add_argument("--accuracy-json", help="gradient accuracy records (skipped when not given)")
    ap.add_argument("--distributions", default="normal,k_bias,qk_bias,v_bias,sharp")
    ap.add_argument("--acc-n", type=int, default=4096)
    args = ap.parse_args()
    if not args.json and not args.accuracy_json:
        ap.error("give --json and/or --accuracy-json")
    if args.accuracy_json:
        with open(args.accuracy_json, "w") as f:
            json.dump(accuracy(args), f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(speed(args), f, indent=1)


if __name__ == "__main__":
    main()
