"""The protocol's timing (docs/performance.md, "Protocol"), shared by the benchmarks."""

import torch


def median_ms(fn, warmup: int, iters: int) -> float:
    """The median of `iters` CUDA-event timings of fn(i), each call synchronized before the
    next starts, after `warmup` calls. i is the call's index, for inputs that alternate."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
