#!/usr/bin/env python3
"""The same calls timed two ways, to separate what the benchmark protocol adds to a call from
the GPU time of its kernels (docs/performance.md, "Protocol").

  synchronized   bench_sdpa.py's protocol: each timed call starts on an idle GPU (the host
                 waits for the previous one), so the events also hold the host time between
                 the start event and the first kernel;
  back to back   the C++ `sage bench` way: the calls are queued without waiting, so each start
                 event fires when the previous call's kernels end;
  queued         synchronized, but the start event is queued behind a GPU sleep longer than
                 the host's work, so the call's kernels are already queued when it fires: the
                 GPU time of one call on a GPU that was idle just before, without the host time.
Also per call: the host time (the call's return after its launches) in the synchronized mode,
and the GPU time of its kernels alone (the profiler's kernel durations, summed).

Shapes as bench_sdpa.py (32 heads, batch = 32K / N, fp16, HND, two input sets alternating).
Needs a CUDA build of sagekit (scripts/python_gpu_install.sh); `scripts/gpu_run.sh timingmodes`
runs it. Prints one line per call and mode: median ms and TOPS of 20 timings after 5 warm-ups.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sagekit

# ~0.5 ms at the H100/H200's clocks: longer than any call's host time.
SLEEP_CYCLES = 1_000_000


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def timings(fn, iters, mode):
    """Median event ms of fn in a mode (above), and the median host ms of its calls."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    host = []
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(ev):
        if mode == "queued":
            torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        t0 = time.perf_counter()
        fn(i)
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        if mode != "back to back":
            b.synchronize()
    torch.cuda.synchronize()
    return median([a.elapsed_time(b) for a, b in ev]), median(host)


def kernel_ms(fn, iters):
    """The GPU durations of a call's kernels, summed, averaged over synchronized calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(i)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    return sum(e.device_time_total for e in kernels) / iters / 1e3


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
                for mode in ("synchronized", "queued", "back to back"):
                    ms, host = timings(fn, args.iters, mode)
                    print(f"d={d:<4} N={n:<6} {name:<22} {mode:<13} {ms:8.3f} ms "
                          f"{ops / ms / 1e9:7.1f} TOPS  host {host:6.3f} ms", flush=True)
                try:
                    ms = kernel_ms(fn, args.iters)
                except Exception as e:  # the profiler's event API moves between torch versions
                    print(f"d={d:<4} N={n:<6} {name:<22} kernels: profiler failed: {e}", flush=True)
                    continue
                print(f"d={d:<4} N={n:<6} {name:<22} {'kernels':<13} {ms:8.3f} ms "
                      f"{ops / ms / 1e9:7.1f} TOPS  (profiler, summed)", flush=True)


if __name__ == "__main__":
    main()
