"""torch custom ops in the namespace "sagekit" (imported by sagekit when torch is present).

Every GPU entry point is a torch.library.custom_op with a fake (meta) implementation, so
torch.compile sees one opaque node with known output shapes (no graph break) and CUDA graph
capture records our kernels like any other op. The op body keeps the capture-safe rules:

  * the workspace comes from torch's caching allocator (torch.empty on q's device), never
    from cudaMalloc, and lives in the graph's private pool while capturing;
  * the kernels run on torch.cuda.current_stream(), passed as its raw cudaStream_t;
  * nothing synchronizes the device or reads a device value on the host (.item() etc.).

Ops:
  torch.ops.sagekit.attention(q, k, v, layout, is_causal, window_left, window_right, scale,
                              recipe, return_lse, q_scale, k_scale, v_scale, out_dtype)
                              -> (out, lse)
    out: q's shape (contiguous, in q's layout), the input dtype (out_dtype, default
    float16, for prequantized int8 inputs); lse: float32 [B, Hq, Nq] when return_lse,
    else an empty tensor. window_left, window_right: the sliding window (-1: unbounded).
    recipe: a preset name, a spec string or "auto".

  torch.ops.sagekit.attention_for_training(q, k, v, layout, is_causal, window_left,
                                           window_right, scale, recipe, return_lse)
                                           -> (out, lse, l2)
    the forward of a training step (what sageattn calls when autograd will record the
    call): sagekit::attention's out and lse, bit for bit, and for a recipe the sm_90 backward
    implements (saves_forward) also l2, the rows' base-2 log-sums (the C++
    attention_for_training), float32 [B, Hq, Nq]; otherwise l2 is an empty tensor (0,).
    Floating inputs only (no prequantized scales, out in q's dtype). Its autograd formula
    saves (q, k, v, out, l2) and calls attention_backward with out= and lse2=, so the
    backward does not run the forward again; lse and l2 are not differentiable.

  torch.ops.sagekit.attention_backward(q, k, v, dout, layout, is_causal, window_left,
                                       window_right, scale, recipe, out=None, lse2=None,
                                       deterministic=False) -> (dq, dk, dv)
    the gradients of sagekit::attention's output (the C++ attention_backward); dq, dk, dv:
    q's, k's and v's shapes, contiguous in the call's layout, q's dtype. Without out and
    lse2 it runs the recipe's forward again, then its backward; with them (the saved
    forward's output and l2, from attention_for_training on the same inputs and options)
    only the K/V pre-pass and the backward, giving the same bits. deterministic: the C++
    BackwardArgs::deterministic (the atomics in a fixed order, so the same bits on every
    run; slower); torch.use_deterministic_algorithms(True) turns it on too. Only recipes
    with a backward (sagebwd, sagebwd_block) and no sliding window; anything else raises
    sagekit.ArgumentError naming `recipe` or `window_size` (`out` / `lse2` for one of the
    pair without the other).
    The autograd formulas of sagekit::attention (the forward again) and of
    sagekit::attention_for_training (the saved forward) call it, passing
    torch.are_deterministic_algorithms_enabled() as `deterministic` (an argument, so that a
    torch.compile'd backward graph holds the choice), so loss.backward() through
    sageattn(..., recipe="sagebwd") works, in eager mode, under torch.compile and in CUDA
    graphs. The LSE output is not differentiable (see _attention_setup_context).

  torch.ops.sagekit.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, is_causal, window_left, window_right,
                                     scale, recipe, return_lse) -> (out, lse)
    a packed variable-length batch (flash_attn_varlen_func's arguments): q [total_q, Hq, D],
    k, v [total_k, Hkv, D], cu_seqlens_* int32 [batch + 1] on q's device (never read on the
    host); out: q's shape and dtype (contiguous); lse: float32 [Hq, total_q] when return_lse,
    else an empty tensor. Every statistic is per sequence; the mask is bottom-right per sequence.

  The same call in two steps (the C++ quantize_kv / attention_from_quantized_kv), so that
  K/V are quantized once and attended many times (a KV cache, several query sets, timing
  the attention kernel without the K/V pre-pass):
  torch.ops.sagekit.quantize_kv(k, v, layout, recipe, k_scale, v_scale) -> workspace
    workspace: a uint8 tensor of kv_workspace_bytes(B, Hkv, Nkv, D, recipe) bytes on k's
    device holding the quantized K/V (opaque: only attention_from_quantized_kv reads it).
  torch.ops.sagekit.attention_from_quantized_kv(q, k, v, workspace, layout, is_causal,
                                                window_left, window_right, scale, recipe,
                                                return_lse, q_scale, k_scale, v_scale,
                                                out_dtype) -> (out, lse)
    as sagekit::attention; k, v (only their shapes are used: the data is not read again),
    layout, recipe and the scales must be those quantize_kv was given.
"""

import contextlib
import functools
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from . import _C
from ._C import ArgumentError
from ._errors import argument_error
from .reference import dlpack_capsule

__all__ = ["attention", "attention_backward", "attention_for_training",
           "attention_from_quantized_kv", "attention_varlen", "quantize_kv"]

# Capability lookups go through the CUDA runtime; one per device and process is enough.
_capability: Dict[int, Tuple[int, int]] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# What "auto" runs on compute capability 9.0: in one call, sage2_8b with the Q/K channel
# balance (docs/recipes.md); K/V quantized ahead of Q (quantize_kv and
# attention_from_quantized_kv) cannot be balanced against a Q it has not seen, so there it is
# sage2_8b.
AUTO_RECIPE = "sage2_8b_balanced"
AUTO_RECIPE_TWO_STEP = "sage2_8b"


def resolve_auto(recipe: str, device: torch.device, two_step: bool = False) -> str:
    """'auto' is sage2_8b_balanced (sage2_8b for the two-step path) on compute capability
    9.0; anything else is an error, not a guess."""
    if recipe != "auto":
        return recipe
    index = _device_index(device)
    cap = _capability.get(index)
    if cap is None:
        cap = _capability[index] = torch.cuda.get_device_capability(index)
    if cap == (9, 0):
        return AUTO_RECIPE_TWO_STEP if two_step else AUTO_RECIPE
    raise RuntimeError(
        f"sagekit: recipe='auto' picks {AUTO_RECIPE} on GPUs of compute capability 9.0 (Hopper); "
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


def _layout_dims(t: torch.Tensor, layout: str, name: str) -> Tuple[Any, Any, Any, Any]:
    """(batch, heads, tokens, head_dim) of a 4-d tensor read through the layout."""
    if t.dim() != 4:
        raise argument_error(name, f"must have 4 dimensions (layout {layout}) (got {t.dim()})")
    if layout == "HND":
        return t.shape[0], t.shape[1], t.shape[2], t.shape[3]
    if layout == "NHD":
        return t.shape[0], t.shape[2], t.shape[1], t.shape[3]
    raise argument_error("layout", "must be 'HND' ([batch, heads, tokens, head_dim]) or "
                         f"'NHD' ([batch, tokens, heads, head_dim]) (got {layout!r})")


# The raw cudaStream_t of torch's current stream on a device, as an int. torch's private
# accessor skips building a torch.cuda.Stream object: 3-7 us of host time per call on the H100
# machines (bench/host_overhead.py, docs/performance.md), where a whole sageattn call spent
# ~70-150 us on the host against ~16-42 us for torch SDPA.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[int]:
    """Makes `device` current while the library launches (it launches on the current device)
    and yields the raw cudaStream_t of torch's current stream there."""
    index = _device_index(device)
    switch = index != torch.cuda.current_device()
    with torch.cuda.device(device) if switch else contextlib.nullcontext():
        yield _raw_stream(index) if _raw_stream else torch.cuda.current_stream(device).cuda_stream


def _allocate(device: torch.device):
    def allocate(nbytes: int):
        # The caching allocator: no cudaMalloc in steady state, stream-ordered reuse, and
        # the private memory pool during CUDA graph capture.
        return dlpack_capsule(torch.empty(nbytes, dtype=torch.uint8, device=device))

    return allocate


def _out_shape(q: torch.Tensor, v: torch.Tensor) -> Tuple[int, ...]:
    """q's shape with V's head dim last (it may differ from Q/K's, as MLA's 192 / 128); a
    malformed v is the library's to refuse by name, so q's shape stands in for it here."""
    return (*q.shape[:-1], v.shape[-1]) if q.dim() >= 1 and v.dim() == q.dim() else tuple(q.shape)


def _outputs(q: torch.Tensor, v: torch.Tensor, layout: str, return_lse: bool,
             out_dtype: Optional[torch.dtype]) -> Tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(_out_shape(q, v), dtype=_out_dtype(q, out_dtype), device=q.device)
    lse = torch.empty(_lse_shape(q, layout, return_lse), dtype=torch.float32, device=q.device)
    return out, lse


def _attention_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, is_causal: bool,
              window_left: int, window_right: int, scale: Optional[float], recipe: str,
              return_lse: bool,
              q_scale: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
              v_scale: Optional[torch.Tensor],
              out_dtype: Optional[torch.dtype]) -> Tuple[torch.Tensor, torch.Tensor]:
    _require_cuda_build()
    recipe = resolve_auto(recipe, q.device)
    out, lse = _outputs(q, v, layout, return_lse, out_dtype)
    with _on_device(q.device) as stream:
        _C.attention(dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v),
                     dlpack_capsule(out), dlpack_capsule(lse) if return_lse else None,
                     layout=layout, causal=is_causal, window_left=window_left,
                     window_right=window_right, sm_scale=scale, recipe=recipe,
                     workspace=_allocate(q.device), stream=stream, q_scale=_capsule(q_scale),
                     k_scale=_capsule(k_scale), v_scale=_capsule(v_scale))
    return out, lse


attention = torch.library.custom_op("sagekit::attention", mutates_args=(),
                                   device_types="cuda")(_attention_body)


@attention.register_fake
def _attention_fake(q, k, v, layout, is_causal, window_left, window_right, scale, recipe,
                    return_lse, q_scale, k_scale, v_scale, out_dtype):
    # Same shapes, dtypes and (contiguous) strides as the real op allocates.
    out = q.new_empty(_out_shape(q, v), dtype=_out_dtype(q, out_dtype))
    lse = q.new_empty(_lse_shape(q, layout, return_lse), dtype=torch.float32)
    return out, lse


# ---- packed variable-length batches ---------------------------------------------------------
# The offsets stay on the device: the op never reads them on the host (no synchronization, and
# a CUDA graph replays with new offsets), so the grid and the workspace come from host-known
# values only (batch, max_seqlen_q / max_seqlen_k, the tensors' sizes).


def _attention_varlen_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                           window_left: int, window_right: int, scale: Optional[float],
                           recipe: str, return_lse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    _require_cuda_build()
    recipe = resolve_auto(recipe, q.device)
    out = torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device)
    lse = torch.empty(_varlen_lse_shape(q, return_lse), dtype=torch.float32, device=q.device)
    with _on_device(q.device) as stream:
        _C.attention_varlen(dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v),
                            dlpack_capsule(cu_seqlens_q), dlpack_capsule(cu_seqlens_k),
                            max_seqlen_q, max_seqlen_k, dlpack_capsule(out),
                            dlpack_capsule(lse) if return_lse else None, causal=is_causal,
                            window_left=window_left, window_right=window_right, sm_scale=scale,
                            recipe=recipe, workspace=_allocate(q.device), stream=stream)
    return out, lse


def _varlen_lse_shape(q: torch.Tensor, return_lse: bool) -> Tuple[int, ...]:
    # FlashAttention's packed LSE: [heads_q, total_q].
    return (q.shape[1], q.shape[0]) if return_lse else (0,)


attention_varlen = torch.library.custom_op("sagekit::attention_varlen", mutates_args=(),
                                          device_types="cuda")(_attention_varlen_body)


@attention_varlen.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           is_causal, window_left, window_right, scale, recipe, return_lse):
    out = q.new_empty(_out_shape(q, v))
    lse = q.new_empty(_varlen_lse_shape(q, return_lse), dtype=torch.float32)
    return out, lse


# ---- the backward (training) ----------------------------------------------------------------

def check_backward_options(window_left: int, window_right: int, is_causal: bool,
                           recipe: str) -> bool:
    """Refuses, by name, what the backward cannot differentiate, before any GPU work; returns
    the causal flag of the backward call.

    The C++ backward has no sliding window: window_size (-1, -1) is none and (-1, 0) is the
    causal mask (the forward computes the same bits for both), anything else is refused. A
    recipe must have a backward (has_backward: sagebwd and its variants); "auto" never has
    one (it is sage2_8b_balanced on compute capability 9.0, an error elsewhere).
    """
    if (window_left, window_right) not in ((-1, -1), (-1, 0)):
        raise argument_error("window_size", "the backward has no sliding window (got "
                             f"({window_left}, {window_right})); train with window_size=(-1, -1) "
                             "(or is_causal=True), or run the windowed call under torch.no_grad()")
    if recipe == "auto":
        raise argument_error("recipe", f"'auto' ({AUTO_RECIPE} on compute capability 9.0) has no "
                             "backward; use recipe='sagebwd' to train, or run the call under "
                             "torch.no_grad()")
    if not _C.has_backward(recipe):  # validates the recipe too (errors name the option)
        raise argument_error("recipe", f"'{recipe}' has no backward; use recipe='sagebwd' to "
                             "train, or run the call under torch.no_grad()")
    return is_causal or window_right == 0


def deterministic_backward() -> bool:
    """Whether the backward sums its atomics in a fixed order: torch's own switch,
    torch.use_deterministic_algorithms (warn_only included: the deterministic backward exists,
    so there is nothing to warn about). The autograd formulas read it when they are traced or
    run and pass it to sagekit::attention_backward as an argument."""
    return torch.are_deterministic_algorithms_enabled()


def _gpu_view(t: torch.Tensor) -> torch.Tensor:
    """t, or a dense copy where the GPU kernels could not read it in place: autograd hands
    the output gradient over with any strides (an expanded scalar from .sum() has stride 0
    everywhere), and the kernels read it in 16-byte pieces along head_dim."""
    es = t.element_size()
    if t.numel() == 0 or ((t.shape[-1] <= 1 or t.stride(-1) == 1)
                          and all(s * es % 16 == 0 for s in t.stride()[:-1])
                          and t.data_ptr() % 16 == 0):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _attention_backward_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             dout: torch.Tensor, layout: str, is_causal: bool, window_left: int,
                             window_right: int, scale: Optional[float], recipe: str,
                             out: Optional[torch.Tensor] = None,
                             lse2: Optional[torch.Tensor] = None,
                             deterministic: bool = False
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    causal = check_backward_options(window_left, window_right, is_causal, recipe)
    if out is not None and lse2 is None:
        # The library would write `out` (the forward again), an input of this op.
        raise argument_error("lse2", "is required with out: the saved forward's output is "
                             "read together with its L2 (attention_for_training's third "
                             "output); pass neither to run the forward again")
    if lse2 is not None and out is None:
        raise argument_error("out", "is required with lse2: the saved forward's output (from "
                             "the same attention_for_training call), read by the backward")
    # torch's switch holds for a direct call of the op too (torch's rule: a deterministic
    # implementation wherever one exists); the formulas pass it anyway.
    deterministic = deterministic or deterministic_backward()
    _require_cuda_build()
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    dout = _gpu_view(dout)
    if out is not None:
        out = _gpu_view(out)  # attention_for_training's own out is dense: no copy
    # Contiguous in the call's layout, q's dtype (the GPU writes each gradient once, rounded to
    # the inputs' 16-bit dtype); autograd accepts any strides for an input's gradient.
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        # Nothing attends (no queries, or no keys: the output is 0 whatever q is), so every
        # gradient is 0; the library's workspace would be empty, which it refuses.
        return dq.zero_(), dk.zero_(), dv.zero_()
    with _on_device(q.device) as stream:
        _C.attention_backward(dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v),
                              dlpack_capsule(dout), dlpack_capsule(dq), dlpack_capsule(dk),
                              dlpack_capsule(dv), out=_capsule(out), layout=layout,
                              causal=causal, sm_scale=scale, recipe=recipe,
                              workspace=_allocate(q.device), stream=stream, lse2=_capsule(lse2),
                              deterministic=deterministic)
    return dq, dk, dv


attention_backward = torch.library.custom_op("sagekit::attention_backward", mutates_args=(),
                                            device_types="cuda")(_attention_backward_body)


@attention_backward.register_fake
def _attention_backward_fake(q, k, v, dout, layout, is_causal, window_left, window_right, scale,
                             recipe, out=None, lse2=None, deterministic=False):
    return (q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype),
            v.new_empty(v.shape, dtype=q.dtype))


def _attention_setup_context(ctx, inputs, output):
    (q, k, v, layout, is_causal, window_left, window_right, scale, recipe, _return_lse,
     _q_scale, _k_scale, _v_scale, _out_dtype) = inputs
    ctx.save_for_backward(q, k, v)
    ctx.options = (layout, is_causal, window_left, window_right, scale, recipe)
    # The LSE is not differentiable, as the logsumexp of torch's own flash and efficient SDPA
    # ops is not: it comes back with requires_grad=False, so no gradient can reach it (a loss
    # through it alone raises torch's "does not require grad"; through out and the LSE, the
    # gradient is out's). The C++ backward has no LSE gradient input.
    ctx.mark_non_differentiable(output[1])


_SCALES = ("q_scale", "k_scale", "v_scale")


def _attention_backward_formula(ctx, grad_out, _grad_lse):
    needs = ctx.needs_input_grad
    for name, need in zip(_SCALES, needs[10:13]):
        if need:
            raise argument_error(name, "prequantized inputs have no gradient (their int8 "
                                 "values and scales are not differentiable); detach it or run "
                                 "the call under torch.no_grad()")
    grads = (None, None, None)
    if any(needs[:3]):
        q, k, v = ctx.saved_tensors
        grads = attention_backward(q, k, v, grad_out, *ctx.options,
                                   deterministic=deterministic_backward())
    return (*(g if need else None for g, need in zip(grads, needs[:3])),) + (None,) * 11


attention.register_autograd(_attention_backward_formula, setup_context=_attention_setup_context)


# ---- the saved forward (training without running the forward twice) ------------------------
# sagekit::attention's formula above runs the recipe's forward again inside the backward
# (15-19% of a forward + backward in the H100 records, docs/performance.md): the backward
# needs the rows' base-2 log-sums L2 and the public forward does not write them. A training
# call therefore goes through sagekit::attention_for_training, which writes L2 as a third,
# non-differentiable output; its formula saves (q, k, v, out, l2) and the backward runs only
# the K/V pre-pass and the backward kernel. Which op runs is decided before the op, by
# call_attention_trainable, from what autograd itself uses: grad mode and the inputs'
# requires_grad (torch.compile traces both as constants and guards on them, so the decision
# is part of the traced program; an inference call, under no_grad or on inputs that need no
# grad, is sagekit::attention as before and writes no L2). Whether L2 is written is then a
# pure function of the op's arguments (saves_forward), which the fake reads as the body does,
# so its output's shape is known at trace time.


@functools.lru_cache(maxsize=None)
def _gpu_backward(recipe: str) -> bool:
    """Whether the sm_90 backward implements `recipe` (cached: a recipe string is parsed once).
    An invalid recipe is False here; the forward then raises its own error naming it."""
    if recipe == "auto":  # sage2_8b_balanced on compute capability 9.0: no backward
        return False
    try:
        return bool(_C.gpu_supports_backward(recipe))
    except ArgumentError:
        return False


def saves_forward(dtype: torch.dtype, recipe: str, window_left: int, window_right: int) -> bool:
    """Whether sagekit::attention_for_training writes L2 for a call (its third output's shape
    depends on it): a 16-bit floating input, a recipe the sm_90 backward implements and no
    sliding window ((-1, 0) is the causal mask). Anything else gets an empty l2 and its
    backward runs the forward again, or raises by name what it cannot differentiate."""
    return (dtype in (torch.float16, torch.bfloat16) and window_left == -1
            and window_right in (-1, 0) and _gpu_backward(recipe))


def _attention_for_training_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                                 is_causal: bool, window_left: int, window_right: int,
                                 scale: Optional[float], recipe: str, return_lse: bool
                                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not saves_forward(q.dtype, recipe, window_left, window_right):
        out, lse = _attention_body(q, k, v, layout, is_causal, window_left, window_right, scale,
                                   recipe, return_lse, None, None, None, None)
        return out, lse, torch.empty((0,), dtype=torch.float32, device=q.device)
    _require_cuda_build()
    l2 = torch.empty(_lse_shape(q, layout, True), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        # Nothing attends: the backward gives zeros without reading l2 (nor calling the
        # library); the rows that see no key have LSE -inf, and so L2.
        out, lse = _attention_body(q, k, v, layout, is_causal, window_left, window_right, scale,
                                   recipe, return_lse, None, None, None, None)
        return out, lse, l2.fill_(float("-inf"))
    out, lse = _outputs(q, v, layout, return_lse, None)
    with _on_device(q.device) as stream:
        # The backward's own options (check_backward_options): the window (-1, 0) is the causal
        # mask, the same bits, so the saved L2 and out are exactly what the backward would
        # compute if it ran the forward again.
        _C.attention_for_training(dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v),
                                  dlpack_capsule(out), dlpack_capsule(l2),
                                  dlpack_capsule(lse) if return_lse else None, layout=layout,
                                  causal=is_causal or window_right == 0, sm_scale=scale,
                                  recipe=recipe, workspace=_allocate(q.device), stream=stream)
    return out, lse, l2


attention_for_training = torch.library.custom_op(
    "sagekit::attention_for_training", mutates_args=(),
    device_types="cuda")(_attention_for_training_body)


@attention_for_training.register_fake
def _attention_for_training_fake(q, k, v, layout, is_causal, window_left, window_right, scale,
                                 recipe, return_lse):
    out, lse = _attention_fake(q, k, v, layout, is_causal, window_left, window_right, scale,
                               recipe, return_lse, None, None, None, None)
    saved = saves_forward(q.dtype, recipe, window_left, window_right)
    return out, lse, q.new_empty(_lse_shape(q, layout, saved), dtype=torch.float32)


def _training_setup_context(ctx, inputs, output):
    q, k, v, layout, is_causal, window_left, window_right, scale, recipe, _return_lse = inputs
    out, lse, l2 = output
    # An l2 of rank 3 is the saved forward's (saves_forward); the empty one (0,) means the
    # backward runs the forward again, as sagekit::attention's formula does. out is saved as
    # it is returned: modifying it in place before the backward is an error from autograd
    # (as for torch's own flash SDPA, which saves its output too).
    if l2.dim() == 3:
        ctx.save_for_backward(q, k, v, out, l2)
    else:
        ctx.save_for_backward(q, k, v)
    ctx.options = (layout, is_causal, window_left, window_right, scale, recipe)
    ctx.mark_non_differentiable(lse, l2)


def _training_backward_formula(ctx, grad_out, _grad_lse, _grad_l2):
    needs = ctx.needs_input_grad
    grads = (None, None, None)
    if any(needs[:3]):
        saved = ctx.saved_tensors
        grads = attention_backward(*saved[:3], grad_out, *ctx.options, *saved[3:],
                                   deterministic=deterministic_backward())
    return (*(g if need else None for g, need in zip(grads, needs[:3])),) + (None,) * 7


attention_for_training.register_autograd(_training_backward_formula,
                                         setup_context=_training_setup_context)


def _head_dim_v(v: torch.Tensor) -> Optional[int]:
    # None (K's head dim) for a malformed v: the library refuses it by name in the op.
    return v.shape[-1] if v.dim() == 4 and type(v.shape[-1]) is int else None


def _quantize_kv_body(k: torch.Tensor, v: torch.Tensor, layout: str, recipe: str,
                k_scale: Optional[torch.Tensor],
                v_scale: Optional[torch.Tensor]) -> torch.Tensor:
    _require_cuda_build()
    recipe = resolve_auto(recipe, k.device, two_step=True)
    nbytes = _C.kv_workspace_bytes(*_layout_dims(k, layout, "k"), recipe=recipe,
                                   head_dim_v=_head_dim_v(v))
    # The workspace is the op's output, so torch owns it and frees it with the last
    # reference. The caching allocator carves blocks at 512-byte multiples out of cudaMalloc'd
    # segments, so the pointer has the 256-byte alignment the library requires.
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=k.device)
    with _on_device(k.device) as stream:
        _C.quantize_kv(dlpack_capsule(k), dlpack_capsule(v), workspace=dlpack_capsule(workspace),
                       layout=layout, recipe=recipe, stream=stream, k_scale=_capsule(k_scale),
                       v_scale=_capsule(v_scale))
    return workspace


quantize_kv = torch.library.custom_op("sagekit::quantize_kv", mutates_args=(),
                                     device_types="cuda")(_quantize_kv_body)


@quantize_kv.register_fake
def _quantize_kv_fake(k, v, layout, recipe, k_scale, v_scale):
    dims = _layout_dims(k, layout, "k")
    if _C.cuda_built and all(type(x) is int for x in dims):
        # kv_workspace_bytes is shape arithmetic (no device is touched), so the fake has the
        # real op's exact size. "auto" only ever runs as AUTO_RECIPE_TWO_STEP here (elsewhere
        # the real op raises), so that is the size it gets.
        nbytes = _C.kv_workspace_bytes(*dims, recipe=AUTO_RECIPE_TWO_STEP if recipe == "auto" else recipe,
                                       head_dim_v=_head_dim_v(v))
    else:
        # No exact count: a build without CUDA has no workspace layout (its
        # kv_workspace_bytes raises, like every GPU entry point there), and symbolic sizes
        # (torch.compile with dynamic shapes) cannot go through the C++ arithmetic. The
        # count is then a fresh unbacked size: nothing in the graph reads the workspace's
        # size except attention_from_quantized_kv, whose outputs do not depend on it.
        nbytes = torch.library.get_ctx().new_dynamic_size()
    return k.new_empty((nbytes,), dtype=torch.uint8)


def _attention_from_quantized_kv_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                workspace: torch.Tensor, layout: str, is_causal: bool,
                                window_left: int, window_right: int,
                                scale: Optional[float], recipe: str, return_lse: bool,
                                q_scale: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                                v_scale: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    _require_cuda_build()
    recipe = resolve_auto(recipe, q.device, two_step=True)
    out, lse = _outputs(q, v, layout, return_lse, out_dtype)
    with _on_device(q.device) as stream:
        _C.attention_from_quantized_kv(
            dlpack_capsule(q), dlpack_capsule(k), dlpack_capsule(v), dlpack_capsule(out),
            dlpack_capsule(lse) if return_lse else None, layout=layout, causal=is_causal,
            window_left=window_left, window_right=window_right,
            sm_scale=scale, recipe=recipe, workspace=dlpack_capsule(workspace), stream=stream,
            q_scale=_capsule(q_scale), k_scale=_capsule(k_scale), v_scale=_capsule(v_scale))
    return out, lse


attention_from_quantized_kv = torch.library.custom_op(
    "sagekit::attention_from_quantized_kv", mutates_args=(),
    device_types="cuda")(_attention_from_quantized_kv_body)


@attention_from_quantized_kv.register_fake
def _attention_from_quantized_kv_fake(q, k, v, workspace, layout, is_causal, window_left,
                                      window_right, scale, recipe, return_lse, q_scale, k_scale,
                                      v_scale, out_dtype):
    return _attention_fake(q, k, v, layout, is_causal, window_left, window_right, scale, recipe,
                           return_lse, q_scale, k_scale, v_scale, out_dtype)


# ---- the eager fast path -------------------------------------------------------------------
# Dispatching a torch.library.custom_op costs ~20 us of host time per call on the H100
# machine (bench/host_overhead.py: the op 56 us, its Python body alone 34 us), which every
# timed call at short N pays. When nothing but plain eager dispatch would see the call, the
# body is what the dispatcher would run, so the front end calls it directly; anything else
# (torch.compile tracing, fake or subclassed tensors, an input that needs grad while grad is
# on (only the op records the autograd node: sagebwd's gradients, or the named refusal of a
# recipe without a backward), dispatch or function modes, functorch transforms) goes through
# the op.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_fast_eager_possible = None not in (_dispatch_modes, _function_modes, _functorch_active)


def plain_eager(args) -> bool:
    """Whether a call with these arguments would reach the op's body with nothing in between."""
    if not _fast_eager_possible or torch.compiler.is_compiling():
        return False
    if _dispatch_modes() or _function_modes() or _functorch_active():
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or (grad and a.requires_grad)):
            return False
    return True


def _fast_eager(op, body, name):
    def call(*args):
        return body(*args) if plain_eager(args) else op(*args)

    call.__doc__ = f"torch.ops.sagekit.{name}, or its body directly where plain_eager(args)."
    return call


call_attention = _fast_eager(attention, _attention_body, "attention")
call_attention_varlen = _fast_eager(attention_varlen, _attention_varlen_body, "attention_varlen")
call_quantize_kv = _fast_eager(quantize_kv, _quantize_kv_body, "quantize_kv")
call_attention_from_quantized_kv = _fast_eager(
    attention_from_quantized_kv, _attention_from_quantized_kv_body, "attention_from_quantized_kv")


def call_attention_trainable(q, k, v, layout, is_causal, window_left, window_right, scale, recipe,
                             return_lse, q_scale, k_scale, v_scale, out_dtype
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """sageattn's call, sagekit::attention's arguments: sagekit::attention_for_training where
    autograd will record it (grad mode on and q, k or v requiring grad; floating inputs with
    out in q's dtype), so that its backward reuses the saved forward; call_attention (the
    op, or its body in plain eager mode) otherwise, which writes no L2."""
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            and q_scale is None and k_scale is None and v_scale is None
            and (out_dtype is None or out_dtype == q.dtype)):
        out, lse, _ = attention_for_training(q, k, v, layout, is_causal, window_left,
                                             window_right, scale, recipe, return_lse)
        return out, lse
    return call_attention(q, k, v, layout, is_causal, window_left, window_right, scale, recipe,
                          return_lse, q_scale, k_scale, v_scale, out_dtype)
