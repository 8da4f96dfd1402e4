#!/usr/bin/env python3
"""Host time per call of the Python front end against torch SDPA (docs/performance.md).

Each row calls one layer of sagekit's call path back to back on a tiny shape (B = H = 1,
N = 128, d = 128), where the GPU finishes long before the host queues the next call, and
reports host microseconds per call: sageattn, the custom op, the front end's eager fast path, the op's
Python body, the body written out by hand, the library call alone, and the pieces (a DLPack export, the stream
lookup, one torch.empty). Needs a CUDA build of sagekit (scripts/python_gpu_install.sh);
`scripts/gpu_run.sh hostbench` runs it.
"""
import time

import torch

import sagekit
import torch.nn.functional as F
from sagekit import ops, _C
from sagekit.reference import dlpack_capsule
q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.float16) for _ in range(3))
dev = q.device
def host_us(fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return h
def body():
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    lse = torch.empty((0,), dtype=torch.float32, device=dev)
    _C.attention(dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v), dlpack_capsule(out), None,
                 layout="HND", causal=False, sm_scale=None, recipe="sage2_8b",
                 workspace=ops._allocate(dev), stream=torch.cuda.current_stream(dev).cuda_stream,
                 q_scale=None, k_scale=None, v_scale=None)
ws = torch.empty(1 << 24, dtype=torch.uint8, device=dev)
caps = lambda nbytes: dlpack_capsule(ws[:nbytes])
stream = torch.cuda.current_stream(dev).cuda_stream
def body_min():
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    _C.attention(dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v), dlpack_capsule(out), None,
                 layout="HND", causal=False, sm_scale=None, recipe="sage2_8b",
                 workspace=caps, stream=stream, q_scale=None, k_scale=None, v_scale=None)
rows = [
  ("sagekit.sageattn", lambda: sagekit.sageattn(q, k, v)),
  ("torch.ops.sagekit.attention", lambda: torch.ops.sagekit.attention(q, k, v, "HND", False, -1, -1, None, "sage2_8b", False, None, None, None, None)),
  ("ops.call_attention (eager fast path)", lambda: ops.call_attention(q, k, v, "HND", False, -1, -1, None, "sage2_8b", False, None, None, None, None)),
  ("op body", lambda: ops._attention_body(q, k, v, "HND", False, None, "sage2_8b", False, None, None, None, None)),
  ("body by hand", body),
  ("body, stream+workspace hoisted", body_min),
  ("dlpack_capsule x1", lambda: dlpack_capsule(q)),
  ("current_stream", lambda: torch.cuda.current_stream(dev).cuda_stream),
  ("torch.empty out", lambda: torch.empty(q.shape, dtype=q.dtype, device=dev)),
  ("resolve_auto", lambda: ops.resolve_auto("auto", dev)),
  ("cudnn sdpa", lambda: F.scaled_dot_product_attention(q, k, v)),
]
for name, fn in rows:
    print(f"{name:38s} {host_us(fn):7.1f} us")
kv = sagekit.quantize_kv(k, v)
print(f"{'sageattn_quantized_kv':38s} {host_us(lambda: sagekit.sageattn_quantized_kv(q, kv)):7.1f} us")
print(f"{'quantize_kv':38s} {host_us(lambda: sagekit.quantize_kv(k, v)):7.1f} us")
print("torch", torch.__version__, "| eager fast path available:", ops._fast_eager_possible)
