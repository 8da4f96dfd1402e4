"""torch custom ops in the namespace "sagekit" (imported by sagekit when torch is present).

Every GPU entry point is a torch.library.custom_op with a fake (meta) implementation, so
torch.compile sees one opaque node with known output shapes (no graph break) and CUDA graph
capture records our kernels like any other op. The op body keeps the capture-safe rules:

  * the workspace comes from torch's caching allocator (torch.empty on q's device), never
    from cudaMalloc, and lives in the graph's private pool while capturing;
  * the kernels run on torch.cuda.current_stream(), passed as its raw cudaStream_t;
  * nothing synchronizes the device or reads a device value on the host (.item() etc.).

Ops:
  torch.ops.sagekit.attention(q, k, v, layout, is_causal, scale, recipe, return_lse,
                              q_scale, k_scale, v_scale, out_dtype) -> (out, lse)
    out: q's shape (contiguous, in q's layout), the input dtype (out_dtype, default
    float16, for prequantized int8 inputs); lse: float32 [B, Hq, Nq] when return_lse,
    else an empty tensor. recipe: a preset name, a spec string or "auto".
"""

from typing import Dict, Optional, Tuple

import torch

from . import _C
from .reference import dlpack_capsule

__all__ = ["attention"]

# Capability lookups go through the CUDA runtime; one per device and process is enough.
_capability: Dict[int, Tuple[int, int]] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def resolve_auto(recipe: str, device: torch.device) -> str:
    """'auto' is sage2_8b on compute capability 9.0; anything else is an error, not a guess."""
    if recipe != "auto":
        return recipe
    index = _device_index(device)
    cap = _capability.get(index)
    if cap is None:
        cap = _capability[index] = torch.cuda.get_device_capability(index)
    if cap == (9, 0):
        return "sage2_8b"
    raise RuntimeError(
        f"sagekit: recipe='auto' picks sage2_8b on GPUs of compute capability 9.0 (Hopper); "
        f"cuda:{index} is {torch.cuda.get_device_name(index)} with compute capability "
        f"{cap[0]}.{cap[1]}, for which sagekit has no kernels (no fallback is taken)")


def _require_cuda_build() -> None:
    if not _C.cuda_built:
        raise RuntimeError(
            "sagekit: this build has no GPU kernels (it was built with SAGE_CUDA=OFF); "
            "reinstall with CUDA (docs/python.md, 'Install'), or use sagekit.simulate on the CPU")


def _out_dtype(q: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    if q.dtype in (torch.float16, torch.bfloat16):
        return q.dtype
    return torch.float16  # prequantized int8 inputs


def _lse_shape(q: torch.Tensor, layout: str, return_lse: bool) -> Tuple[int, ...]:
    if not return_lse:
        return (0,)
    if layout == "HND":
        return (q.shape[0], q.shape[1], q.shape[2])
    return (q.shape[0], q.shape[2], q.shape[1])


def _capsule(t: Optional[torch.Tensor]):
    return None if t is None else dlpack_capsule(t)


@torch.library.custom_op("sagekit::attention", mutates_args=(), device_types="cuda")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, is_causal: bool,
              scale: Optional[float], recipe: str, return_lse: bool,
              q_scale: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
              v_scale: Optional[torch.Tensor],
              out_dtype: Optional[torch.dtype]) -> Tuple[torch.Tensor, torch.Tensor]:
    _require_cuda_build()
    device = q.device
    recipe = resolve_auto(recipe, device)
    out = torch.empty(q.shape, dtype=_out_dtype(q, out_dtype), device=device)
    lse = torch.empty(_lse_shape(q, layout, return_lse), dtype=torch.float32, device=device)

    def allocate(nbytes: int):
        # The caching allocator: no cudaMalloc in steady state, stream-ordered reuse, and
        # the private memory pool during CUDA graph capture.
        return dlpack_capsule(torch.empty(nbytes, dtype=torch.uint8, device=device))

    # The library launches on the current device; a tensor on another one needs a switch.
    switch = _device_index(device) != torch.cuda.current_device()
    guard = torch.cuda.device(device) if switch else None
    if guard is not None:
        guard.__enter__()
    try:
        stream = torch.cuda.current_stream(device).cuda_stream
        _C.attention(dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v),
                     dlpack_capsule(out), dlpack_capsule(lse) if return_lse else None,
                     layout=layout, causal=is_causal, sm_scale=scale, recipe=recipe,
                     workspace=allocate, stream=stream, q_scale=_capsule(q_scale),
                     k_scale=_capsule(k_scale), v_scale=_capsule(v_scale))
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)
    return out, lse


@attention.register_fake
def _attention_fake(q, k, v, layout, is_causal, scale, recipe, return_lse, q_scale, k_scale,
                    v_scale, out_dtype):
    # Same shapes, dtypes and (contiguous) strides as the real op allocates.
    out = q.new_empty(q.shape, dtype=_out_dtype(q, out_dtype))
    lse = q.new_empty(_lse_shape(q, layout, return_lse), dtype=torch.float32)
    return out, lse


# TODO(quantization ops): when the C++ API exposes the quantization pre-passes on their own
# (K smoothing + quantization, V transpose + per-channel FP8, as separate entry points in
# include/sage/), bind them in python/src/module.cpp and register each one here the same
# way: a torch.library.custom_op("sagekit::quantize_k" / "sagekit::quantize_v", ...) that
# allocates its outputs and workspace with torch.empty on the input's device, launches on
# torch.cuda.current_stream(), and has a register_fake giving the quantized tensors' and
# scales' shapes; then attention can take the quantized K/V (Inputs::prequantized) so a
# KV cache is quantized once.
