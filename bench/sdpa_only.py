#!/usr/bin/env python3
"""torch SDPA (flash, cuDNN) alone on the quick grid: a stand-in until the Python package
can time sagekit in the same process (bench_sdpa.py)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

for d in (64, 128):
    for causal in (False, True):
        for n in (1024, 4096, 16384):
            b = 32768 // n
            q, k, v = (torch.randn(b, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
            res = []
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                with sdpa_kernel(be):
                    for _ in range(3):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    ts = []
                    for _ in range(10):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record(); F.scaled_dot_product_attention(q, k, v, is_causal=causal); e.record(); e.synchronize()
                        ts.append(s.elapsed_time(e))
                ms = sorted(ts)[5]
                res.append(f"{name} {4 * b * 32 * n * n * d / (2 if causal else 1) / ms / 1e9:6.0f}")
            print(f"d={d} causal={int(causal)} n={n}: " + "  ".join(res), flush=True)
