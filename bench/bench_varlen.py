#!/usr/bin/env python3
"""Packed variable-length batches against a dense sagekit call at the batch's mean length
(issue 34's varlen bar: >= 90% of its TOPS, counting only the real, unpadded work).

The batch: 32 sequences with lengths drawn uniformly from [128, 8192] (fixed seed), d = 128,
heads x d = 4096 (32 heads), fp16, causal and not. Timed, whole call as a user makes it
(median of CUDA-event timings after warm-up; docs/performance.md's protocol):
  * sagekit varlen: sagekit.sageattn_varlen on the packed batch;
  * sagekit dense: sagekit.sageattn on 32 sequences of the mean length (rounded to 128);
  * reference lines: torch SDPA (cuDNN) one sequence at a time, and on the batch padded to the
    longest sequence (its TOPS count only the real work as well).
TOPS count the real work: 4 n_q n_k d heads per sequence without a mask, and the visible
(query, key) pairs only under causal (bottom-right; n (n + 1) / 2 for n_q = n_k = n).
Writes JSON records (the keys of bench/results/h100.json plus kind="varlen", d_v, window)
and a Markdown table. Not run on a GPU yet.
"""
import argparse
import json
import random

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import median_ms

import sagekit



def pairs(n, causal):
    return n * (n + 1) // 2 if causal else n * n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=0, help="0: 4096 // d")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--recipe", default="sage2_8b")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()

    d, heads = args.d, args.heads or 4096 // args.d
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.sequences)]
    total, longest = sum(lengths), max(lengths)
    mean = max(128, round(total / len(lengths) / 128) * 128)
    dev = torch.cuda.get_device_name()
    dt = torch.float16
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q = torch.randn(total, heads, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(total, heads, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(total, heads, d, device="cuda", dtype=dt, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    dq = torch.randn(len(lengths), heads, mean, d, device="cuda", dtype=dt, generator=g)
    dk, dv = torch.randn_like(dq), torch.randn_like(dq)
    padded = [torch.zeros(len(lengths), heads, longest, d, device="cuda", dtype=dt) for _ in range(3)]
    starts = cu.tolist()
    for b, n in enumerate(lengths):
        for t, src in zip(padded, (q, k, v)):
            t[b, :, :n] = src[starts[b]:starts[b] + n].transpose(0, 1)
    seqs = [tuple(src[starts[b]:starts[b] + n].transpose(0, 1).unsqueeze(0).contiguous() for src in (q, k, v))
            for b, n in enumerate(lengths)]

    records, rows = [], []
    for causal in [bool(int(c)) for c in args.causal.split(",")]:
        real = 4 * d * heads * sum(pairs(n, causal) for n in lengths)
        dense_work = 4 * d * heads * len(lengths) * pairs(mean, causal)
        runs = {
            "sagekit-varlen": (lambda: sagekit.sageattn_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                               recipe=args.recipe), real),
            "sagekit-dense-mean": (lambda: sagekit.sageattn(dq, dk, dv, is_causal=causal, recipe=args.recipe),
                                   dense_work),
        }

        def per_sequence():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for sq, sk, sv in seqs:
                    F.scaled_dot_product_attention(sq, sk, sv, is_causal=causal)

        def padded_batch():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(*padded, is_causal=causal)

        runs["torch-cudnn-per-sequence"] = (per_sequence, real)
        runs["torch-cudnn-padded"] = (padded_batch, real)
        row = {}
        for impl, (fn, work) in runs.items():
            try:
                ms = median_ms(lambda _, fn=fn: fn(), args.warmup, args.iters)
            except Exception as e:  # a backend that refuses the shape is recorded, not fatal
                print(f"{impl} causal={causal}: {type(e).__name__}: {e}")
                continue
            tops = work / (ms * 1e-3) / 1e12
            row[impl] = tops
            records.append(dict(impl=impl, kind="varlen", recipe=args.recipe if impl.startswith("sagekit") else "fp16",
                                d=d, d_v=d, window=[-1, -1], causal=causal,
                                n=mean if impl == "sagekit-dense-mean" else None, lengths=lengths,
                                batch=len(lengths), heads=heads, dtype="float16", whole_call=True, ms=ms,
                                tops=tops, device=dev))
            print(f"{impl:26s} causal={int(causal)} {ms:8.3f} ms {tops:7.1f} TOPS")
        rows.append((causal, row))

    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    lines = [f"Packed batch of {len(lengths)} sequences, lengths uniform in [{args.min_len}, {args.max_len}] "
             f"(seed {args.seed}; mean {total / len(lengths):.0f}, longest {longest}), d = {d}, {heads} heads, "
             f"fp16, recipe {args.recipe}, on {dev}: TOPS of the real work (median of {args.iters}).", "",
             "| causal | sagekit varlen | sagekit dense at the mean | varlen / dense (bar 0.90) | cuDNN per sequence | cuDNN padded |",
             "|---|---|---|---|---|---|"]
    nan = float("nan")
    for causal, row in rows:
        vl, dn = row.get("sagekit-varlen", nan), row.get("sagekit-dense-mean", nan)
        lines.append(f"| {'yes' if causal else 'no'} | {vl:.0f} | {dn:.0f} | {vl / dn:.2f} | "
                     f"{row.get('torch-cudnn-per-sequence', nan):.0f} | {row.get('torch-cudnn-padded', nan):.0f} |")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
