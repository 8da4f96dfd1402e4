#!/usr/bin/env python3
"""The same calls timed two ways, to separate what the benchmark protocol adds to a call from
the GPU time of its kernels (docs/performance.md, "Python protocol against sage bench").

  synchronized   bench_sdpa.py's protocol: each timed call starts on an idle GPU (the host
                 waits for the previous one), so the events also hold the host time between
                 the start event and the first kernel;
  back to back   the C++ `sage bench` way: the calls are queued without waiting, so each start
                 event fires when the previous call's kernels end.

Shapes as bench_sdpa.py (32 heads, batch = 32K / N, fp16, HND, two input sets alternating).
Needs a CUDA build of sagekit (scripts/python_gpu_install.sh); `scripts/gpu_run.sh timingmodes`
runs it. Prints one line per call and mode: median ms and TOPS of 20 timings after 5 warm-ups.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sagekit


def timings(fn, iters, synchronized):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(i)
        b.record()
        if synchronized:
            b.synchronize()
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in ev)
    return ms[len(ms) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="1024,4096")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    heads, tokens = 32, 32768
    for d in map(int, args.dims.split(",")):
        for n in map(int, args.ns.split(",")):
            batch = tokens // n
            sets = [[torch.randn(batch, heads, n, d, device="cuda", dtype=torch.float16)
                     for _ in range(3)] for _ in range(2)]
            kvs = [sagekit.quantize_kv(k, v) for _, k, v in sets]

            def cudnn(i):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(*sets[i % 2])

            calls = {
                "sageattn": lambda i: sagekit.sageattn(*sets[i % 2]),
                "sageattn_quantized_kv": lambda i: sagekit.sageattn_quantized_kv(sets[i % 2][0], kvs[i % 2]),
                "cudnn sdpa": cudnn,
            }
            ops = 4.0 * batch * heads * n * n * d
            for name, fn in calls.items():
                for i in range(5):
                    fn(i)
                for mode, sync in (("synchronized", True), ("back to back", False)):
                    ms = timings(fn, args.iters, sync)
                    print(f"d={d:<4} N={n:<6} {name:<22} {mode:<13} {ms:8.3f} ms "
                          f"{ops / ms / 1e9:7.1f} TOPS", flush=True)


if __name__ == "__main__":
    main()
