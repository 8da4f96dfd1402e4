"""The torch front end: sageattn, a drop-in scaled_dot_product_attention and patch_sdpa, and
the same attention in two steps (quantize_kv, then sageattn_quantized_kv).

Everything here is plain Python over tensor metadata followed by calls of the custom ops
torch.ops.sagekit.* (ops.call_*: the op itself whenever anything but plain eager dispatch
would see the call, so torch.compile(fullgraph=True) traces it without a break; its Python
body directly otherwise, which saves the dispatcher's host time).
Argument checks raise sagekit.ArgumentError (a ValueError) naming the argument, before any
work is queued; checks that need the library (head dims, recipe validity on this GPU) run in
the op and raise the same error type.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, NamedTuple, Optional, Tuple

import torch

from . import ops  # registers torch.ops.sagekit.*
from ._errors import argument_error, checked_scale, checked_window
from ._recipes import RecipeLike, recipe_key

__all__ = ["sageattn", "scaled_dot_product_attention", "patch_sdpa", "SdpaPatch", "QuantizedKV",
           "quantize_kv", "sageattn_quantized_kv"]

_FLOATS = (torch.float16, torch.bfloat16)


# Checks run in two passes, what the tensors are and then where they live, so that a
# shape or dtype mistake is reported the same way on any device (and testable on the CPU).
def _check_tensor(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise argument_error(name, f"must be a torch.Tensor (got {type(t).__name__})")


def _check_cuda(t: torch.Tensor, name: str, first: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise argument_error(name, f"must be on a CUDA device (got {t.device}); "
                             "sagekit.simulate runs a recipe on the CPU")
    if t.device != first.device:
        raise argument_error(name, f"must be on {first.device} like the other inputs "
                             f"(got {t.device})")


def _check_last_dim(t: torch.Tensor, name: str) -> None:
    # Quantization reads a token's head_dim values as one vector; other strides are free.
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise argument_error(name, f"the last dimension (head_dim) must be contiguous (stride 1, "
                             f"got {t.stride(-1)}); other strides, storage offsets and views "
                             "are accepted as they are")


def _check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout.upper() not in ("HND", "NHD"):
        raise argument_error("layout", "must be 'HND' ([batch, heads, tokens, head_dim]) or "
                             f"'NHD' ([batch, tokens, heads, head_dim]) (got {layout!r})")
    return layout.upper()


def sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
             scale: Optional[float] = None, layout: str = "HND", recipe: RecipeLike = "auto",
             return_lse: bool = False, *, window_size: Tuple[int, int] = (-1, -1),
             q_scale: Optional[torch.Tensor] = None,
             k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
             out_dtype: Optional[torch.dtype] = None):
    """Quantized attention on the GPU: softmax(scale * q k^T [+ mask]) v.

    q [B, Hq, Nq, D], k/v [B, Hkv, Nkv, D] for layout "HND" ([B, N, H, D] for "NHD"),
    float16 or bfloat16 CUDA tensors; Hq a multiple of Hkv (GQA / MQA). v may have a head
    dim Dv of its own (DeepSeek MLA: D = 192, Dv = 128); the output then has Dv. Views with any
    strides and storage offsets are used in place; only head_dim must be contiguous.
    is_causal aligns the mask bottom-right (query i sees keys j <= i + Nkv - Nq).
    window_size = (left, right), FlashAttention's sliding window: query i sees keys j with
    i + Nkv - Nq - left <= j <= i + Nkv - Nq + right, -1 for an unbounded side; is_causal is
    right = 0 and combines with a left bound (right must then be -1 or 0). Only the window's
    K/V tiles are computed. A query row that sees no key gets output 0 and LSE -inf.
    scale defaults to 1/sqrt(D). recipe: "auto" (sage2_8b_balanced on compute capability
    9.0, an error elsewhere), a preset name, a spec string or a dict of options.
    Returns the output (q's shape with v's head dim, q's dtype), and with return_lse also the float32
    natural-log sum of exp [B, Hq, Nq].
    Prequantized inputs (recipe "int_flash"): int8 q/k/v with float32 q_scale, k_scale,
    v_scale; out_dtype picks the output dtype (default float16).
    Training: with recipe="sagebwd" the output is differentiable (loss.backward() gives q, k
    and v their gradients through SageBwd's INT8 backward, which reuses this call's saved
    forward rather than running it again; the LSE has no gradient); with any other recipe,
    or a sliding window, a backward pass raises an ArgumentError naming `recipe` (or
    `window_size`). docs/python.md, "Training".
    """
    layout = _check_layout(layout)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name)
        if t.dim() != 4:
            raise argument_error(name, f"must have 4 dimensions (layout {layout}) (got {t.dim()})")
        _check_last_dim(t, name)
    prequantized = q_scale is not None or k_scale is not None or v_scale is not None
    if not prequantized and q.dtype not in _FLOATS:
        raise argument_error("q", f"dtype must be torch.float16 or torch.bfloat16 (got {q.dtype})")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise argument_error(name, f"dtype must equal q's {q.dtype} (got {t.dtype})")
    scales = ((q_scale, "q_scale"), (k_scale, "k_scale"), (v_scale, "v_scale"))
    for t, name in scales:
        if t is not None:
            _check_tensor(t, name)
    for t, name in ((q, "q"), (k, "k"), (v, "v")) + scales:
        if t is not None:
            _check_cuda(t, name, q)
    if not isinstance(is_causal, bool):
        raise argument_error("is_causal", f"must be a bool (got {type(is_causal).__name__})")
    left, right = checked_window(window_size, is_causal)
    scale = checked_scale(scale)
    # A call autograd will record goes through sagekit::attention_for_training, whose
    # backward reuses the saved forward; any other is sagekit::attention.
    out, lse = ops.call_attention_trainable(q, k, v, layout, is_causal, left, right, scale,
                                            recipe_key(recipe), return_lse, q_scale, k_scale,
                                            v_scale, out_dtype)
    return (out, lse) if return_lse else out


class QuantizedKV(NamedTuple):
    """K and V quantized once by sagekit.quantize_kv, for any number of
    sagekit.sageattn_quantized_kv calls. Treat it as opaque.

    workspace: the quantized K/V (a uint8 CUDA tensor in the library's own layout); k, v:
    the tensors it was made from, kept for their shapes (the attention kernel does not read
    them again, so changing them afterwards changes nothing until quantize_kv runs again);
    layout, recipe, k_scale, v_scale: as given to quantize_kv. A NamedTuple, so that
    torch.compile traces through it.
    """

    workspace: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str
    recipe: str
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None


def quantize_kv(k: torch.Tensor, v: torch.Tensor, layout: str = "HND",
                recipe: RecipeLike = "auto", *, k_scale: Optional[torch.Tensor] = None,
                v_scale: Optional[torch.Tensor] = None) -> QuantizedKV:
    """Step one of sageattn: quantizes K and V the way `recipe` says, once.

    k/v [B, Hkv, Nkv, D] for layout "HND" ([B, N, H, D] for "NHD"), float16 or bfloat16
    CUDA tensors, any strides with a contiguous head_dim (as sageattn). Returns a
    QuantizedKV for sageattn_quantized_kv, which then runs only the attention kernel: a
    KV cache or a set of keys shared by many queries is quantized once, and the kernel
    can be timed on its own. sageattn(q, k, v, ...) equals
    sageattn_quantized_kv(q, quantize_kv(k, v, ...), ...) bit for bit.
    Prequantized inputs (recipe "int_flash"): int8 k/v with float32 k_scale and v_scale.
    """
    layout = _check_layout(layout)
    for t, name in ((k, "k"), (v, "v")):
        _check_tensor(t, name)
        if t.dim() != 4:
            raise argument_error(name, f"must have 4 dimensions (layout {layout}) (got {t.dim()})")
        _check_last_dim(t, name)
    prequantized = k_scale is not None or v_scale is not None
    if not prequantized and k.dtype not in _FLOATS:
        raise argument_error("k", f"dtype must be torch.float16 or torch.bfloat16 (got {k.dtype})")
    if v.dtype != k.dtype:
        raise argument_error("v", f"dtype must equal k's {k.dtype} (got {v.dtype})")
    scales = ((k_scale, "k_scale"), (v_scale, "v_scale"))
    for t, name in scales:
        if t is not None:
            _check_tensor(t, name)
    for t, name in ((k, "k"), (v, "v")) + scales:
        if t is not None:
            _check_cuda(t, name, k)
    key = recipe_key(recipe)
    workspace = ops.call_quantize_kv(k, v, layout, key, k_scale, v_scale)
    return QuantizedKV(workspace, k, v, layout, key, k_scale, v_scale)


def sageattn_quantized_kv(q: torch.Tensor, kv: QuantizedKV, is_causal: bool = False,
                          scale: Optional[float] = None, return_lse: bool = False, *,
                          window_size: Tuple[int, int] = (-1, -1),
                          q_scale: Optional[torch.Tensor] = None,
                          out_dtype: Optional[torch.dtype] = None):
    """Step two of sageattn: attention of q over K/V that quantize_kv already quantized.

    q [B, Hq, Nq, D] in kv's layout, kv's dtype and device, Hq a multiple of kv's heads;
    the recipe is kv's. is_causal, scale, return_lse, window_size, q_scale and out_dtype as
    in sageattn.
    Only the attention kernel runs (no K/V pre-pass); kv is read, never changed, so it
    serves any number of calls.
    """
    if not isinstance(kv, QuantizedKV):
        raise argument_error("kv", "must be what sagekit.quantize_kv returned (got "
                             f"{type(kv).__name__})")
    _check_tensor(q, "q")
    if q.dim() != 4:
        raise argument_error("q", f"must have 4 dimensions (layout {kv.layout}) (got {q.dim()})")
    _check_last_dim(q, "q")
    k = kv.k
    if q.dtype != k.dtype:
        raise argument_error("q", f"dtype must equal the quantized K/V's {k.dtype} (got {q.dtype})")
    _check_cuda(q, "q", k)
    # Shape mismatches are named after q here; the library would name k, which this call
    # does not take.
    heads = 2 if kv.layout == "NHD" else 1
    if q.shape[0] != k.shape[0]:
        raise argument_error("q", f"batch must equal the quantized K/V's batch {k.shape[0]} "
                             f"(got {q.shape[0]})")
    if q.shape[3] != k.shape[3]:
        raise argument_error("q", f"head_dim must equal the quantized K/V's head_dim "
                             f"{k.shape[3]} (got {q.shape[3]})")
    if k.shape[heads] > 0 and q.shape[heads] % k.shape[heads] != 0:
        raise argument_error("q", f"heads must be a multiple of the quantized K/V's heads "
                             f"{k.shape[heads]} (got {q.shape[heads]})")
    if not isinstance(is_causal, bool):
        raise argument_error("is_causal", f"must be a bool (got {type(is_causal).__name__})")
    left, right = checked_window(window_size, is_causal)
    if q_scale is not None:
        _check_tensor(q_scale, "q_scale")
        _check_cuda(q_scale, "q_scale", k)
    scale = checked_scale(scale)
    out, lse = ops.call_attention_from_quantized_kv(
        q, k, kv.v, kv.workspace, kv.layout, is_causal, left, right, scale, kv.recipe,
        return_lse, q_scale, kv.k_scale, kv.v_scale, out_dtype)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: Optional[float] = None, enable_gqa: bool = False, *,
                                 recipe: RecipeLike = "auto") -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention, computed by sagekit.

    Same signature and semantics for what sagekit supports: inputs [..., H, L, E] (3-D
    [N, L, E] and more than one batch dimension work too), float16/bfloat16 on a CUDA
    device, E equal for query and key, value's Ev its own (as torch: MLA's E = 192, Ev = 128).
    What it cannot honor is an error naming the
    argument, never silently dropped: attn_mask, dropout_p > 0, and is_causal with L != S
    (torch aligns that mask top-left, sagekit bottom-right; use sageattn for the latter).
    enable_gqa=False with different head counts raises, as torch does.
    recipe="sagebwd" makes it trainable (loss.backward()), as in sageattn.
    """
    if attn_mask is not None:
        raise argument_error("attn_mask", "sagekit cannot apply an explicit attention mask; "
                             "pass attn_mask=None (is_causal=True gives the causal mask)")
    if dropout_p != 0.0:
        raise argument_error("dropout_p", f"sagekit has no attention dropout; pass 0.0 "
                             f"(got {dropout_p}; models usually pass it only in training mode)")
    named = ((query, "query"), (key, "key"), (value, "value"))
    for t, name in named:
        _check_tensor(t, name)
        if t.dim() < 3:
            raise argument_error(name, f"must have at least 3 dimensions [..., L, E] (got {t.dim()})")
        if t.dtype not in _FLOATS:
            raise argument_error(name, f"dtype must be torch.float16 or torch.bfloat16 "
                                 f"(got {t.dtype}); sagekit quantizes half-precision inputs")
        _check_last_dim(t, name)
    if key.dim() != query.dim() or value.dim() != query.dim():
        raise argument_error("key", f"query, key and value must have the same number of "
                             f"dimensions (got {query.dim()}, {key.dim()}, {value.dim()})")
    L, S = query.shape[-2], key.shape[-2]
    if is_causal and L != S:
        raise argument_error("is_causal", f"with L != S (L={L}, S={S}) torch aligns the causal "
                             "mask top-left and sagekit bottom-right; use sagekit.sageattn for "
                             "the bottom-right (KV cache) convention")
    batch_shape = query.shape[:-2]
    if query.dim() == 3:
        q4, k4, v4 = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    elif query.dim() == 4:
        q4, k4, v4 = query, key, value
    else:
        # Several batch dimensions fold into one; reshape copies only if they cannot.
        q4 = query.reshape((-1,) + tuple(query.shape[-3:]))
        k4 = key.reshape((-1,) + tuple(key.shape[-3:]))
        v4 = value.reshape((-1,) + tuple(value.shape[-3:]))
    hq, hkv = q4.shape[1], k4.shape[1]
    if hq != hkv:
        if not enable_gqa:
            raise argument_error("enable_gqa", f"query has {hq} heads and key/value {hkv}; "
                                 "pass enable_gqa=True for grouped-query attention")
        if hq % hkv != 0:
            raise argument_error("key", f"query's heads {hq} must be a multiple of key's {hkv}")
    for t, name in named:
        _check_cuda(t, name, query)
    out = sageattn(q4, k4, v4, is_causal=is_causal, scale=scale, layout="HND", recipe=recipe)
    if query.dim() == 4:
        return out
    return out.reshape(tuple(batch_shape) + (L, value.shape[-1]))


@dataclass
class SdpaPatch:
    """What happened while patch_sdpa was active (filled in eager mode; under
    torch.compile the counts reflect tracing, not every replay)."""

    recipe: RecipeLike = "auto"
    fallback: bool = False
    calls: int = 0
    fallbacks: Dict[str, int] = field(default_factory=dict)


def _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> Optional[str]:
    """Why sagekit would refuse this call, or None (mirrors the checks above)."""
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p != 0.0:
        return "dropout_p"
    for t in (query, key, value):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.dtype not in _FLOATS:
            return "device/dtype"
        if t.dim() < 3 or t.dim() != query.dim():
            return "rank"
    if is_causal and query.shape[-2] != key.shape[-2]:
        return "is_causal with L != S"
    if query.shape[-3] != key.shape[-3] and query.dim() > 3 and not enable_gqa:
        return "enable_gqa"
    return None


@contextlib.contextmanager
def patch_sdpa(recipe: RecipeLike = "auto", fallback: bool = False) -> Iterator[SdpaPatch]:
    """Routes torch.nn.functional.scaled_dot_product_attention to sagekit inside the block.

        with sagekit.patch_sdpa() as stats:
            y = model(x)          # every F.scaled_dot_product_attention call is sagekit's

    Code that looks the function up at call time (torch.nn.functional.<name>, as timm and
    transformers do) is patched; a name imported before the block is not. With
    fallback=False (the default) a call sagekit cannot honor raises an ArgumentError naming
    the argument. fallback=True sends such calls to the original torch function instead and
    counts them, by reason, in the yielded SdpaPatch (stats.fallbacks), so nothing changes
    silently. The original function is restored on exit, also after an exception.
    patch_sdpa(recipe="sagebwd") trains: the recorded graph's backward runs sagekit's, also
    when loss.backward() is called after the block.
    """
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    stats = SdpaPatch(recipe=recipe, fallback=fallback)

    def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        if fallback:
            reason = _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
            if reason is not None:
                stats.fallbacks[reason] = stats.fallbacks.get(reason, 0) + 1
                kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
                return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                is_causal=is_causal, scale=scale, **kwargs)
        stats.calls += 1
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                            scale, enable_gqa, recipe=recipe)

    patched.__doc__ = scaled_dot_product_attention.__doc__
    patched.__wrapped__ = original
    F.scaled_dot_product_attention = patched
    try:
        yield stats
    finally:
        F.scaled_dot_product_attention = original
