"""The reference SageAttention package's entry points, computed by sagekit.

    from sagekit.compat import sageattn      # in place of: from sageattention import sageattn

Every function here has the reference package's name and exactly its parameter names, order
and defaults (sageattention 2.2.0), so code written for it runs unchanged. Each call maps its
arguments onto a sagekit recipe and runs sagekit.sageattn; `plan(function, ...)` returns that
mapping without running anything (no GPU, no torch needed), which is also how the mapping is
tested. docs/python.md, "Coming from the SageAttention package", has the table.

Where sagekit does not do what an argument asks, the call raises instead of passing silently:
- unknown keyword arguments raise TypeError naming them (the reference accepts and ignores
  them, so a misspelled option there changes nothing without a word);
- values without a sagekit GPU kernel (FP16 P·V with an FP32 accumulator, FP8 P·V
  accumulated in FP22 over the whole row, FP16 accumulation over the whole row) and explicit
  attention masks raise ArgumentError (a ValueError) naming the parameter and the nearest
  supported value;
- `smooth_v` is applied wherever it is given (the reference ignores it, with a warning, for
  most accumulators);
- `tensor_layout` must be "HND" or "NHD" (the reference reads anything else as "HND").
Head dims that the library does not take as they are (below 32, or not a multiple of 8) are
zero-padded to the next one it takes and the output cut back, as the reference pads to 64 or
128: exact, since zero channels change neither
Q K^T nor the kept output channels, and the default scale stays 1/sqrt(original head dim).
"""

import math
from typing import Any, Dict, NamedTuple, Optional, Union

# sagekit's torch front end (a stub that raises ImportError naming torch where it is missing;
# the mapping below and plan() need neither torch nor a GPU).
from . import sageattn as _sagekit_sageattn
from . import sageattn_varlen as _sagekit_sageattn_varlen
from ._errors import argument_error, checked_scale

__all__ = ["CompatCall", "plan", "sageattn", "sageattn_qk_int8_pv_fp16_triton",
           "sageattn_qk_int8_pv_fp16_cuda", "sageattn_qk_int8_pv_fp8_cuda",
           "sageattn_qk_int8_pv_fp8_cuda_sm90", "sageattn_varlen"]

# The head dims the library takes without a copy (sagekit.gpu_head_dims(): multiples of 8 from
# 32 up to its largest kernel tile, padded with zero channels inside the kernel, issue 34); any
# other head dim up to the largest is zero-padded here to the next one. A build without CUDA
# (whose list is empty) keeps what a CUDA build of this source takes.
def _accepted_head_dims() -> tuple:
    try:
        from . import gpu_head_dims
        dims = tuple(gpu_head_dims())
    except ImportError:
        dims = ()
    return dims or tuple(range(32, 129, 8))


_KERNEL_HEAD_DIMS = _accepted_head_dims()


class CompatCall(NamedTuple):
    """What a compat call runs: sagekit.sageattn(q, k, v, is_causal, scale, layout, recipe,
    return_lse) on q, k, v zero-padded from head_dim to padded_head_dim channels; for
    sageattn_varlen (layout "packed"), sagekit.sageattn_varlen with causal and softmax_scale."""

    recipe: Union[str, Dict[str, Any]]  # "auto", or options over a base preset (sagekit.recipe)
    layout: str                         # "HND", "NHD", or "packed" ([total_tokens, heads, head_dim])
    is_causal: bool
    scale: Optional[float]              # None: sagekit's default, 1/sqrt(head_dim)
    return_lse: bool
    head_dim: int
    padded_head_dim: int


# ---- argument checks (each error names the reference's parameter) ---------------------------

def _refuse_unknown(function: str, kwargs: Dict[str, Any]) -> None:
    if kwargs:
        names = ", ".join(repr(k) for k in kwargs)
        raise TypeError(f"{function}() got unexpected keyword argument(s) {names}; "
                        "sagekit.compat refuses options it would otherwise ignore (the reference "
                        "package accepts and ignores unknown keywords)")


def _choice(name: str, value: Any, allowed: tuple) -> str:
    if not isinstance(value, str) or value not in allowed:
        listed = ", ".join(repr(a) for a in allowed)
        raise argument_error(name, f"must be one of {listed} (got {value!r})")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise argument_error(name, f"must be a bool (got {type(value).__name__})")
    return value


def _head_dims(q: Any, packed: bool = False) -> tuple:
    shape = getattr(q, "shape", None)
    if packed and (shape is None or len(shape) != 3):
        raise argument_error("q", "must be a 3-d tensor [total_tokens, heads, head_dim]")
    if not packed and (shape is None or len(shape) != 4):
        raise argument_error("q", "must be a 4-d tensor ([batch, heads, tokens, head_dim] for "
                             "tensor_layout 'HND', [batch, tokens, heads, head_dim] for 'NHD')")
    head_dim = int(shape[-1])
    for padded in _KERNEL_HEAD_DIMS:
        if 0 < head_dim <= padded:
            return head_dim, padded
    raise argument_error("q", f"head_dim must be from 1 to {_KERNEL_HEAD_DIMS[-1]} (got "
                         f"{head_dim}); others are zero-padded to the next of {_KERNEL_HEAD_DIMS}")


def _call(recipe: Union[str, Dict[str, Any]], q: Any, tensor_layout: Any, is_causal: Any,
          sm_scale: Any, return_lse: Any, packed: bool = False) -> CompatCall:
    # packed: sageattn_varlen's [total_tokens, heads, head_dim], which has no tensor_layout.
    layout = "packed" if packed else _choice("tensor_layout", tensor_layout, ("HND", "NHD"))
    head_dim, padded = _head_dims(q, packed)
    scale = checked_scale(sm_scale, "sm_scale")
    if scale is None and padded != head_dim:
        scale = 1.0 / math.sqrt(head_dim)  # the original head dim's, as the library computes it
    return CompatCall(recipe, layout, _flag("is_causal", is_causal), scale,
                      _flag("return_lse", return_lse), head_dim, padded)


def _int8_qk(base: str, qk_quant_gran: Any, smooth_k: Any, smooth_v: Any = False) -> Dict[str, Any]:
    return {"base": base,
            "qk_granularity": _choice("qk_quant_gran", qk_quant_gran, ("per_thread", "per_warp")),
            "smooth_k": _flag("smooth_k", smooth_k), "smooth_v": _flag("smooth_v", smooth_v)}


def _no_kernel(value: str, what: str, instead: str) -> Exception:
    return argument_error("pv_accum_dtype", f"{value!r} ({what}) has no sagekit GPU kernel; "
                          f"{instead}")


# ---- the mappings: the reference's parameters -> a sagekit call -------------------------------

def _plan_sageattn(q, tensor_layout, is_causal, sm_scale, return_lse, kwargs) -> CompatCall:
    _refuse_unknown("sageattn", kwargs)
    # The reference picks a kernel by GPU architecture; sagekit's "auto" does the same.
    return _call("auto", q, tensor_layout, is_causal, sm_scale, return_lse)


def _plan_fp16_triton(q, tensor_layout, quantization_backend, is_causal, attn_mask, sm_scale,
                      smooth_k, return_lse, kwargs) -> CompatCall:
    _refuse_unknown("sageattn_qk_int8_pv_fp16_triton", kwargs)
    # Where the reference quantizes (a Triton or a CUDA kernel) does not change its numbers;
    # sagekit quantizes in its own pre-pass either way.
    _choice("quantization_backend", quantization_backend, ("triton", "cuda"))
    if attn_mask is not None:
        raise argument_error("attn_mask", "sagekit cannot apply an explicit attention mask; "
                             "pass attn_mask=None (is_causal=True gives the causal mask)")
    # Per-block INT8 Q/K, FP16 P·V accumulated in FP16 per KV block and added into FP32:
    # SageAttention's SAGEAttn-B, sagekit's sage1_b.
    recipe = {"base": "sage1_b", "smooth_k": _flag("smooth_k", smooth_k)}
    return _call(recipe, q, tensor_layout, is_causal, sm_scale, return_lse)


def _plan_fp16_cuda(q, tensor_layout, is_causal, qk_quant_gran, sm_scale, pv_accum_dtype,
                    smooth_k, smooth_v, return_lse, kwargs) -> CompatCall:
    _refuse_unknown("sageattn_qk_int8_pv_fp16_cuda", kwargs)
    accum = _choice("pv_accum_dtype", pv_accum_dtype, ("fp32", "fp16+fp32", "fp16"))
    instead = ("pass pv_accum_dtype='fp16+fp32' (FP16 accumulation per KV block added into FP32, "
               "sagekit's sage1 numerics), or use sageattn_qk_int8_pv_fp8_cuda_sm90 on Hopper")
    if accum == "fp32":
        raise _no_kernel(accum, "FP16 P·V with an FP32 accumulator", instead)
    if accum == "fp16":
        raise _no_kernel(accum, "one FP16 accumulator over the whole row", instead)
    recipe = _int8_qk("sage1_b", qk_quant_gran, smooth_k, smooth_v)
    return _call(recipe, q, tensor_layout, is_causal, sm_scale, return_lse)


def _fp8_recipe(accum: str, qk_quant_gran, smooth_k, smooth_v) -> Dict[str, Any]:
    # INT8 Q/K, FP8 E4M3 P and V: "fp32+fp32" is SageAttention2's FP22 accumulator per KV
    # block added into FP32 (sage2_8b), "fp32+fp16" SageAttention2++'s FP16 accumulation of two
    # k32 steps added into FP32 (sage2pp_8b: P to 112 and V to 4.5, where the reference
    # package scales V to 2.25).
    if accum == "fp32":
        raise _no_kernel(accum, "FP8 P·V accumulated in FP22 over the whole row",
                         "pass pv_accum_dtype='fp32+fp32' (a fresh FP22 accumulator per KV "
                         "block, added into FP32: sage2_8b)")
    base = "sage2_8b" if accum == "fp32+fp32" else "sage2pp_8b"
    return _int8_qk(base, qk_quant_gran, smooth_k, smooth_v)


def _plan_fp8_cuda(q, tensor_layout, is_causal, qk_quant_gran, sm_scale, pv_accum_dtype,
                   smooth_k, smooth_v, return_lse, kwargs) -> CompatCall:
    _refuse_unknown("sageattn_qk_int8_pv_fp8_cuda", kwargs)
    accum = _choice("pv_accum_dtype", pv_accum_dtype, ("fp32", "fp32+fp32", "fp32+fp16"))
    recipe = _fp8_recipe(accum, qk_quant_gran, smooth_k, smooth_v)
    return _call(recipe, q, tensor_layout, is_causal, sm_scale, return_lse)


def _plan_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, sm_scale,
                 smooth_k, kwargs) -> CompatCall:
    _refuse_unknown("sageattn_varlen", kwargs)
    # The reference's packed path is its Triton kernel: per-block INT8 Q/K and FP16 P·V, the
    # numbers of sageattn_qk_int8_pv_fp16_triton (sage1_b). Its K mean is taken over the whole
    # packed batch; sagekit takes every statistic per sequence (nothing leaks between
    # sequences), which changes quantization error only: smoothing K leaves the softmax exact.
    recipe = {"base": "sage1_b", "smooth_k": _flag("smooth_k", smooth_k)}
    return _call(recipe, q, None, is_causal, sm_scale, False, packed=True)


def _plan_fp8_cuda_sm90(q, tensor_layout, is_causal, qk_quant_gran, sm_scale, pv_accum_dtype,
                        smooth_k, return_lse, kwargs) -> CompatCall:
    _refuse_unknown("sageattn_qk_int8_pv_fp8_cuda_sm90", kwargs)
    accum = _choice("pv_accum_dtype", pv_accum_dtype, ("fp32", "fp32+fp32"))
    recipe = _fp8_recipe(accum, qk_quant_gran, smooth_k, False)
    return _call(recipe, q, tensor_layout, is_causal, sm_scale, return_lse)


# ---- running a mapped call ---------------------------------------------------------------------

def _padded(call: CompatCall, q: Any, k: Any, v: Any) -> tuple:
    """q, k, v zero-padded to the call's head dim. The reference's kernels take one head dim
    for all three (sagekit.sageattn takes a V head dim of its own), so v's must be q's."""
    if getattr(v, "shape", None) is not None and len(v.shape) >= 1 and int(v.shape[-1]) != call.head_dim:
        raise argument_error("v", f"head_dim must equal q's head_dim {call.head_dim} in the "
                             f"reference's API (got {int(v.shape[-1])}); sagekit.sageattn takes "
                             "a V head dim of its own")
    pad = call.padded_head_dim - call.head_dim
    if not pad:
        return q, k, v
    import torch.nn.functional as F

    return tuple(F.pad(t, (0, pad)) for t in (q, k, v))


def _run(call: CompatCall, q: Any, k: Any, v: Any):
    pad = call.padded_head_dim - call.head_dim
    q, k, v = _padded(call, q, k, v)
    result = _sagekit_sageattn(q, k, v, is_causal=call.is_causal, scale=call.scale,
                               layout=call.layout, recipe=call.recipe,
                               return_lse=call.return_lse)
    out, lse = result if call.return_lse else (result, None)
    if pad:
        out = out[..., :call.head_dim]
    return (out, lse) if call.return_lse else out


# ---- the reference's entry points ----------------------------------------------------------------

def sageattn(q, k, v, tensor_layout: str = "HND", is_causal: bool = False,
             sm_scale: Optional[float] = None, return_lse: bool = False, **kwargs: Any):
    """The reference's automatic entry point: sagekit.sageattn with recipe "auto"
    (sage2_8b_balanced on Hopper; elsewhere an error, as sagekit has kernels for compute capability 9.0 only).

    q [B, Hq, Nq, D], k/v [B, Hkv, Nkv, D] for tensor_layout "HND" ([B, N, H, D] for "NHD"),
    float16/bfloat16 CUDA tensors, D <= 128. Returns the output, and with return_lse also the
    float32 natural-log LSE [B, Hq, Nq]. is_causal aligns the mask bottom-right when Nq != Nkv.
    """
    return _run(_plan_sageattn(q, tensor_layout, is_causal, sm_scale, return_lse, kwargs),
                q, k, v)


def sageattn_qk_int8_pv_fp16_triton(q, k, v, tensor_layout: str = "HND",
                                    quantization_backend: str = "triton", is_causal: bool = False,
                                    attn_mask=None, sm_scale: Optional[float] = None,
                                    smooth_k: bool = True, return_lse: bool = False,
                                    **kwargs: Any):
    """Per-block INT8 Q/K and FP16 P·V (sagekit's sage1_b, with smooth_k as given).
    attn_mask must be None; quantization_backend "triton" or "cuda" (the same numbers)."""
    return _run(_plan_fp16_triton(q, tensor_layout, quantization_backend, is_causal, attn_mask,
                                  sm_scale, smooth_k, return_lse, kwargs), q, k, v)


def sageattn_qk_int8_pv_fp16_cuda(q, k, v, tensor_layout: str = "HND", is_causal: bool = False,
                                  qk_quant_gran: str = "per_thread",
                                  sm_scale: Optional[float] = None, pv_accum_dtype: str = "fp32",
                                  smooth_k: bool = True, smooth_v: bool = False,
                                  return_lse: bool = False, **kwargs: Any):
    """INT8 Q/K (per_thread or per_warp) and FP16 P·V. Only pv_accum_dtype "fp16+fp32" has a
    sagekit kernel (sage1_b's accumulation); the default "fp32" and "fp16" raise, naming it."""
    return _run(_plan_fp16_cuda(q, tensor_layout, is_causal, qk_quant_gran, sm_scale,
                                pv_accum_dtype, smooth_k, smooth_v, return_lse, kwargs), q, k, v)


def sageattn_qk_int8_pv_fp8_cuda(q, k, v, tensor_layout: str = "HND", is_causal: bool = False,
                                 qk_quant_gran: str = "per_thread",
                                 sm_scale: Optional[float] = None,
                                 pv_accum_dtype: str = "fp32+fp16", smooth_k: bool = True,
                                 smooth_v: bool = False, return_lse: bool = False,
                                 **kwargs: Any):
    """INT8 Q/K (per_thread or per_warp) and FP8 P·V: pv_accum_dtype "fp32+fp16" is
    sage2pp_8b, "fp32+fp32" sage2_8b; "fp32" (FP22 over the whole row) raises."""
    return _run(_plan_fp8_cuda(q, tensor_layout, is_causal, qk_quant_gran, sm_scale,
                               pv_accum_dtype, smooth_k, smooth_v, return_lse, kwargs), q, k, v)


def sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout: str = "HND", is_causal: bool = False,
                                      qk_quant_gran: str = "per_thread",
                                      sm_scale: Optional[float] = None,
                                      pv_accum_dtype: str = "fp32+fp32", smooth_k: bool = True,
                                      return_lse: bool = False, **kwargs: Any):
    """The reference's Hopper kernel: INT8 Q/K (per_thread or per_warp), FP8 P·V with a
    per-block FP22 accumulator added into FP32 (sagekit's sage2_8b)."""
    return _run(_plan_fp8_cuda_sm90(q, tensor_layout, is_causal, qk_quant_gran, sm_scale,
                                    pv_accum_dtype, smooth_k, return_lse, kwargs), q, k, v)


def sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    is_causal: bool = False, sm_scale: Optional[float] = None,
                    smooth_k: bool = True, **kwargs: Any):
    """Packed variable-length batches (q [total_q, heads, head_dim], k/v [total_k, heads_kv,
    head_dim], int32 cu_seqlens on the device): sagekit.sageattn_varlen with sage1_b's numbers
    (INT8 Q/K per block, FP16 P·V), every statistic per sequence; is_causal aligns each
    sequence's mask bottom-right (the same as top-left where a sequence has as many queries as
    keys)."""
    call = _plan_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                        sm_scale, smooth_k, kwargs)
    pad = call.padded_head_dim - call.head_dim
    q, k, v = _padded(call, q, k, v)
    out = _sagekit_sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, softmax_scale=call.scale, causal=call.is_causal,
                                   recipe=call.recipe)
    return out[..., :call.head_dim] if pad else out


_PLANNERS = {
    sageattn: _plan_sageattn,
    sageattn_qk_int8_pv_fp16_triton: _plan_fp16_triton,
    sageattn_qk_int8_pv_fp16_cuda: _plan_fp16_cuda,
    sageattn_qk_int8_pv_fp8_cuda: _plan_fp8_cuda,
    sageattn_qk_int8_pv_fp8_cuda_sm90: _plan_fp8_cuda_sm90,
    sageattn_varlen: _plan_varlen,
}


def plan(function, *args: Any, **kwargs: Any) -> CompatCall:
    """The sagekit call `function(*args, **kwargs)` would make, without making it.

    `function` is one of this module's entry points (or its name); the arguments are exactly
    what the call would take (q only needs a .shape; k and v are not looked at). Raises the
    errors the call would raise. Needs neither torch nor a GPU.

        >>> plan(sageattn_qk_int8_pv_fp8_cuda, q, k, v, qk_quant_gran="per_warp").recipe
        {'base': 'sage2pp_8b', 'qk_granularity': 'per_warp', 'smooth_k': True, 'smooth_v': False}
    """
    import inspect

    if isinstance(function, str):
        function = globals().get(function)
    planner = _PLANNERS.get(function)
    if planner is None:
        names = ", ".join(f.__name__ for f in _PLANNERS)
        raise argument_error("function", f"must be one of {names} (or its name)")
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = {name: value for name, value in bound.arguments.items() if name not in ("k", "v")}
    return planner(**arguments)
