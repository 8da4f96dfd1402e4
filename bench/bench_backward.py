#!/usr/bin/env python3
"""SageBwd on the GPU (issue 33): speed of forward + backward against torch SDPA, and the
gradients' accuracy against float64 beside SDPA's in bf16.

    python3 bench/bench_backward.py --json backward.json [--accuracy-json acc.json]

Speed: the attention op alone as training calls it, whole call including every
quantization, bf16, d 64/128 x causal x N 1K-16K, 32 heads, 32K tokens per call; passes
"fwd" (out = attn(q, k, v)), "bwd" (torch.autograd.grad of a kept graph) and "fwd_bwd" (both, as a training step runs
them). Median of CUDA-event timings after warm-up, two input sets alternated. TOPS count
4 N^2 d per head for fwd, 2.5x that for bwd, 3.5x for fwd_bwd (halved when causal), the
FlashAttention convention. Records have bench_sdpa.py's keys plus "pass".
"sagekit" is sageattn as training calls it: sagekit::attention_for_training, whose backward
reuses the saved forward (its L2 and output) and runs only the K/V pre-pass again; "fwd" (under
no_grad) is sagekit::attention, which writes no L2. --rerun adds "sagekit-rerun", the op
sagekit::attention called directly, whose backward runs the whole forward again (the path
before the saved forward was wired into Python): the A/B of the two in one run.
--deterministic adds "sagekit-deterministic", sageattn with every pass run under
torch.use_deterministic_algorithms(True) (the backward's deterministic mode; torch's filling of
uninitialized memory left off, so that the kernels' cost alone is timed): its cost against
"sagekit" in one run.

Accuracy (--accuracy-json): N = 4096, d = 128, one batch, 2 heads, bf16 inputs from a few of
the synthetic distributions (docs/numerics.md; drawn here with torch, not the library's
generator), dO ~ N(0, 1): cosine and relative L1 of dQ, dK, dV against float64 autograd,
for --recipe (default sagebwd) and for SDPA in bf16 (its flash backend) on the GPU, and for the
bit-faithful CPU simulator (sagekit.simulate_backward) with the recipe and with its INT8-dP ablation
(dp_format=int8, which has no GPU kernel), on the same inputs. The simulator rows need no GPU
and give the same numbers on any machine (about 2 minutes on 2 cores); without CUDA only they
run. --accuracy-impls picks the rows, --accuracy-merge keeps an existing file's other records:

    python3 bench/bench_backward.py --accuracy-json bench/results/h100_backward_accuracy.json \
        --accuracy-impls simulator,simulator-int8dp --accuracy-merge
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import median_ms



def attention_impls(causal: bool, recipe: str, rerun: bool = False, deterministic: bool = False):
    import sagekit

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    def rerun_forward(q, k, v):  # sagekit::attention's backward runs the forward again
        return torch.ops.sagekit.attention(q, k, v, "HND", causal, -1, -1, None, recipe, False,
                                           None, None, None, None)[0]

    impls = {"sagekit": lambda q, k, v: sagekit.sageattn(q, k, v, is_causal=causal, recipe=recipe)}
    if rerun:
        impls["sagekit-rerun"] = rerun_forward
    if deterministic:
        impls["sagekit-deterministic"] = impls["sagekit"]
    impls.update({"torch-flash": sdpa(SDPBackend.FLASH_ATTENTION),
                  "torch-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)})
    return impls


def under_deterministic_algorithms(fn):
    """fn with torch's deterministic switch on while it runs (the backward reads it when it runs)."""
    import torch.utils.deterministic

    def run(i):
        fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            fn(i)
        finally:
            torch.use_deterministic_algorithms(False)
            torch.utils.deterministic.fill_uninitialized_memory = fill
    return run


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
        for name, attn in attention_impls(bool(causal), args.recipe, args.rerun,
                                          args.deterministic).items():
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
                if name == "sagekit-deterministic":
                    fn = under_deterministic_algorithms(fn)
                try:
                    ms = median_ms(fn, args.warmup, args.iters)
                except Exception as e:  # a backend that refuses the shape is reported, not hidden
                    print(f"  {name} {pass_name}: failed: {e}", file=sys.stderr)
                    continue
                tops = factor * fwd_ops / (ms * 1e-3) / 1e12
                row[f"{name} {pass_name}"] = tops
                records.append(dict(impl=name, recipe=args.recipe if name.startswith("sagekit") else "bf16",
                                    d=d, causal=bool(causal), n=n, batch=batch, heads=args.heads,
                                    dtype="bfloat16", whole_call=True, ms=ms, tops=tops, device=dev,
                                    **{"pass": pass_name}))
            kept = None  # frees the graphs (a del trips pyflakes on the closures)
        sets = douts = None
        torch.cuda.empty_cache()
        s = row.get("sagekit fwd_bwd", float("nan"))
        print(f"[{idx + 1}/{len(grid)}] d={d} causal={causal} n={n}: fwd+bwd TOPS sagekit {s:.0f} "
              f"flash {row.get('torch-flash fwd_bwd', float('nan')):.0f} "
              f"cudnn {row.get('torch-cudnn fwd_bwd', float('nan')):.0f}  "
              f"vs flash {s / row.get('torch-flash fwd_bwd', float('nan')):.2f}x "
              f"vs cudnn {s / row.get('torch-cudnn fwd_bwd', float('nan')):.2f}x "
              + (f"vs re-run forward {s / row.get('sagekit-rerun fwd_bwd', float('nan')):.2f}x "
                 if args.rerun else "")
              + (f"deterministic bwd {row.get('sagekit-deterministic bwd', float('nan')) / row.get('sagekit bwd', float('nan')):.2f}x "
                 if args.deterministic else "")
              + f"({time.time() - t0:.0f}s)", flush=True)
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


def profile_call(args, point: str) -> None:
    """Two fwd + bwd calls of sageattn at one point ("d,n,causal"), for a profiler that skips
    the first backward launch (gpu_run.sh bwdprofile)."""
    import sagekit

    d, n, causal = map(int, point.split(","))
    batch = max(1, args.tokens // n)
    qkv = [torch.randn(batch, args.heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3)]
    dout = torch.randn(batch, args.heads, n, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        out = sagekit.sageattn(*qkv, is_causal=bool(causal), recipe=args.recipe)
        torch.autograd.grad(out, qkv, dout)
    torch.cuda.synchronize()
    print(f"profiled d={d} n={n} causal={causal} batch={batch} heads={args.heads}")


# Accuracy rows: the GPU's (sagekit.sageattn, torch SDPA) and the CPU simulator's recipes.
# The recipe (--recipe) runs as "sagekit" on the GPU and "simulator" on the CPU; "simulator-int8dp"
# is its INT8-dP ablation (dp_format=int8, simulator only).
GPU_IMPLS = ("sagekit", "torch-sdpa-bf16")
SIMULATOR_OPTIONS = {"simulator": "", "simulator-int8dp": ",dp_format=int8"}


def gradient_metrics(grads, ref) -> dict:
    """Cosine, relative L1 and NaN presence of dq, dk, dv against the float64 reference."""
    row = {}
    for label, g, r in zip(("dq", "dk", "dv"), grads, ref):
        g = g.detach().double().cpu()
        row[f"{label}_cosine"] = F.cosine_similarity(g.flatten(), r.flatten(), dim=0).item()
        row[f"{label}_rel_l1"] = ((g - r).abs().sum() / r.abs().sum()).item()
        row[f"{label}_nan"] = bool(torch.isnan(g).any())
    return row


def accuracy(args):
    import sagekit

    impls = args.accuracy_impls.split(",")
    unknown = [i for i in impls if i not in GPU_IMPLS and i not in SIMULATOR_OPTIONS]
    if unknown:
        raise ValueError(f"unknown --accuracy-impls {unknown}; known: "
                         f"{', '.join(GPU_IMPLS + tuple(SIMULATOR_OPTIONS))}")
    cuda = torch.cuda.is_available()
    if not cuda and any(i in GPU_IMPLS for i in impls):
        print(f"no CUDA: skipping {', '.join(i for i in impls if i in GPU_IMPLS)}", flush=True)
        impls = [i for i in impls if i not in GPU_IMPLS]
    gpu_fns = {"sagekit": lambda a, b, c: sagekit.sageattn(a, b, c, recipe=args.recipe),
               "torch-sdpa-bf16": lambda a, b, c: F.scaled_dot_product_attention(a, b, c)}
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.time()
    for dist in args.distributions.split(","):
        # Drawn on the CPU from one seeded generator, in the same order whatever runs, so the
        # GPU and simulator rows of a distribution see the same values.
        q64, k64, v64 = distribution(dist, args.acc_n, 128, args.acc_heads, gen)
        do64 = torch.randn(q64.shape, generator=gen, dtype=torch.float64)
        # Every implementation sees the same bf16 values; the reference differentiates them in float64.
        q, k, v, do = (x.to(torch.bfloat16) for x in (q64, k64, v64, do64))
        ref_in = [x.double().to(dev).requires_grad_() for x in (q, k, v)]
        ref = torch.autograd.grad(F.scaled_dot_product_attention(*ref_in), ref_in, do.double().to(dev))
        ref = [r.cpu() for r in ref]
        del ref_in
        for name in impls:
            t1 = time.time()
            if name in GPU_IMPLS:
                inputs = [x.cuda().requires_grad_() for x in (q, k, v)]
                grads = torch.autograd.grad(gpu_fns[name](*inputs), inputs, do.cuda())
            else:
                grads = sagekit.simulate_backward(q, k, v, do, recipe=args.recipe + SIMULATOR_OPTIONS[name])
            recipe = "bf16" if name == "torch-sdpa-bf16" else args.recipe + SIMULATOR_OPTIONS.get(name, "")
            row = dict(distribution=dist, impl=name, recipe=recipe, n=args.acc_n, d=128, dtype="bfloat16",
                       heads=args.acc_heads)
            row.update(gradient_metrics(grads, ref))
            rows.append(row)
            print(f"{dist:8s} {name:24s} " + "  ".join(
                f"{x}: cos {row[x + '_cosine']:.6f} L1 {row[x + '_rel_l1']:.4f}" for x in ("dq", "dk", "dv"))
                + f"  ({time.time() - t1:.0f}s, {time.time() - t0:.0f}s in all)", flush=True)
    return rows


def merged_records(old: list, new: list) -> list:
    """old's records with those new replaces (same distribution and impl) dropped, and new's
    added; grouped by distribution in order of first appearance, each group's order kept."""
    keys = {(r["distribution"], r["impl"]) for r in new}
    rows = [r for r in old if (r["distribution"], r["impl"]) not in keys] + new
    order = {}
    for r in rows:
        order.setdefault(r["distribution"], len(order))
    return sorted(rows, key=lambda r: order[r["distribution"]])


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
    ap.add_argument("--acc-heads", type=int, default=2)
    ap.add_argument("--recipe", default="sagebwd", help="a preset with a backward")
    ap.add_argument("--rerun", action="store_true",
                    help="also time sagekit-rerun (the backward that runs the forward again)")
    ap.add_argument("--deterministic", action="store_true",
                    help="also time sagekit-deterministic (torch.use_deterministic_algorithms(True))")
    ap.add_argument("--accuracy-impls", default=",".join(GPU_IMPLS + tuple(SIMULATOR_OPTIONS)),
                    help="accuracy rows to compute (the GPU ones are skipped without CUDA)")
    ap.add_argument("--accuracy-merge", action="store_true",
                    help="keep the --accuracy-json file's records other than those recomputed")
    ap.add_argument("--profile-call", metavar="D,N,CAUSAL",
                    help="only run two fwd + bwd calls at this point (for ncu; gpu_run.sh bwdprofile)")
    args = ap.parse_args()
    if args.profile_call:
        profile_call(args, args.profile_call)
        return
    if not args.json and not args.accuracy_json:
        ap.error("give --json and/or --accuracy-json")
    if args.accuracy_json:
        rows = accuracy(args)
        if args.accuracy_merge and os.path.exists(args.accuracy_json):
            with open(args.accuracy_json) as f:
                rows = merged_records(json.load(f), rows)
        with open(args.accuracy_json, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(speed(args), f, indent=1)


if __name__ == "__main__":
    main()
