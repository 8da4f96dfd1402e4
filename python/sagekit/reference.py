"""The CPU references on NumPy arrays or CPU torch tensors.

`simulate` computes a recipe with exactly the GPU kernel's quantization (same scales,
rounding, encodings, accumulators), so it shows what a recipe does to your tensors on a
machine without the GPU. `exact` is attention in float64. Both return float32 outputs of
the same kind as their inputs (NumPy in, NumPy out; torch in, torch out).
`simulate_backward` and `exact_backward` are the same pair for the gradients (training):
the recipe's backward (sagebwd, docs/numerics.md "The backward") and float64 gradients.
"""

import numbers
import sys
from typing import Any, Optional, Tuple

from . import _C
from ._errors import argument_error, checked_scale, checked_window
from ._recipes import RecipeLike


def _torch():
    # torch is never imported here: if the caller has a torch tensor, torch is loaded.
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_numpy(x: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout.upper() not in ("HND", "NHD"):
        raise argument_error("layout", "must be 'HND' ([batch, heads, tokens, head_dim]) or "
                             f"'NHD' ([batch, tokens, heads, head_dim]) (got {layout!r})")
    return layout.upper()


def _lse_shape(shape: Tuple[int, ...], layout: str) -> Tuple[int, int, int]:
    if layout == "HND":
        return (shape[0], shape[1], shape[2])
    return (shape[0], shape[2], shape[1])


def dlpack_capsule(t: Any) -> Any:
    """A torch tensor as a DLPack capsule, exported without any stream synchronization.

    Tensor.__dlpack__() (which nanobind would call) makes the legacy default stream wait on
    the current one in recent torch releases; that is an extra dependency outside CUDA
    graphs and an error inside a capture. The capsule exporter does no stream work.
    """
    torch = _torch()
    export = getattr(torch._C, "_to_dlpack", None) or torch.utils.dlpack.to_dlpack
    return export(t)


def _host_capsule(t: Any, name: str) -> Any:
    """A CPU torch tensor as a DLPack capsule (nanobind reads NumPy arrays directly)."""
    if t.device.type != "cpu":
        raise argument_error(name, f"must be on the CPU for simulate/exact (got a tensor on "
                             f"{t.device}; use .cpu(), or sagekit.sageattn on the GPU)")
    return dlpack_capsule(t.detach())


def _input_kind(q: Any) -> str:
    """'torch' or 'numpy': what q is, which every other array of the call must match."""
    if _is_torch(q):
        return "torch"
    if _is_numpy(q):
        return "numpy"
    raise argument_error("q", f"must be a NumPy array or a CPU torch tensor (got {type(q).__name__})")


def _require_kind(kind: str, named: dict) -> None:
    for name, x in named.items():
        if not (_is_torch(x) if kind == "torch" else _is_numpy(x)):
            raise argument_error(name, f"must be a {'torch tensor' if kind == 'torch' else 'NumPy array'} "
                                 f"like q (got {type(x).__name__})")


def _run(fn, q, k, v, recipe, is_causal, scale, layout, return_lse, q_scale, k_scale, v_scale,
         window_size):
    layout = _layout(layout)
    if not isinstance(is_causal, bool):
        raise argument_error("is_causal", f"must be a bool (got {type(is_causal).__name__})")
    left, right = checked_window(window_size, is_causal)
    scale = checked_scale(scale)
    kind = _input_kind(q)
    named = {"q": q, "k": k, "v": v, "q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    _require_kind(kind, {n: x for n, x in named.items() if not (x is None and n.endswith("_scale"))})
    if q.ndim != 4:
        raise argument_error("q", f"must have 4 dimensions ({'[batch, heads, tokens, head_dim]' if layout == 'HND' else '[batch, tokens, heads, head_dim]'}, "
                             f"layout {layout}) (got {q.ndim})")
    # The output has V's head dim (MLA: Q/K 192, V 128); the library checks v itself.
    dv = int(v.shape[-1]) if getattr(v, "ndim", 0) == 4 else int(q.shape[-1])
    shape = tuple(int(s) for s in q.shape[:-1]) + (dv,)
    if kind == "torch":
        torch = _torch()
        out = torch.empty(shape, dtype=torch.float32)
        lse = torch.empty(_lse_shape(shape, layout), dtype=torch.float32) if return_lse else None
        conv = {n: (None if x is None else _host_capsule(x, n)) for n, x in named.items()}
        out_arg = dlpack_capsule(out)
        lse_arg = None if lse is None else dlpack_capsule(lse)
    else:
        import numpy as np

        out = np.empty(shape, dtype=np.float32)
        lse = np.empty(_lse_shape(shape, layout), dtype=np.float32) if return_lse else None
        conv, out_arg, lse_arg = named, out, lse
    fn(conv["q"], conv["k"], conv["v"], out_arg, lse_arg, layout=layout, causal=is_causal,
       window_left=left, window_right=right, sm_scale=scale, recipe=recipe,
       q_scale=conv["q_scale"], k_scale=conv["k_scale"], v_scale=conv["v_scale"])
    return (out, lse) if return_lse else out


def simulate(q, k, v, recipe: RecipeLike = "sage2_8b", is_causal: bool = False,
             scale: Optional[float] = None, layout: str = "HND", return_lse: bool = False,
             q_scale=None, k_scale=None, v_scale=None, window_size: Tuple[int, int] = (-1, -1)):
    """The recipe on the CPU, bit for bit the GPU kernel's quantization.

    q, k, v: NumPy arrays or CPU torch tensors, float16/bfloat16 (int8 with q_scale,
    k_scale, v_scale for prequantized recipes), [B, H, N, D] ("HND") or [B, N, H, D]
    ("NHD"); heads of q a multiple of heads of k/v (GQA). recipe: a preset name, a spec
    string or a dict of options ("auto" means sage2_8b_balanced, what the Hopper path
    runs for "auto"). window_size = (left, right): the sliding window as in sagekit.sageattn.
    Returns a float32 output of q's shape with v's head dim (and the float32 natural-log LSE, [B, H, N], with
    return_lse=True), as NumPy or torch like the inputs; a row that sees no key gets 0 and
    an LSE of -inf.
    """
    if isinstance(recipe, str) and recipe == "auto":
        recipe = "sage2_8b_balanced"
    return _run(_C.simulate, q, k, v, recipe, is_causal, scale, layout, return_lse,
                q_scale, k_scale, v_scale, window_size)


def exact(q, k, v, is_causal: bool = False, scale: Optional[float] = None, layout: str = "HND",
          return_lse: bool = False, recipe: Optional[RecipeLike] = None,
          q_scale=None, k_scale=None, v_scale=None, window_size: Tuple[int, int] = (-1, -1)):
    """Attention in float64 on the CPU, returned as float32 (same arguments as simulate).

    The recipe only says how to read prequantized inputs: it defaults to "int_flash" when
    q_scale is given and to "sage2_8b" (plain fp16/bf16 inputs) otherwise.
    """
    if recipe is None or (isinstance(recipe, str) and recipe == "auto"):
        recipe = "int_flash" if q_scale is not None else "sage2_8b"
    return _run(_C.exact, q, k, v, recipe, is_causal, scale, layout, return_lse,
                q_scale, k_scale, v_scale, window_size)


def _new_float32(kind: str, shape: Tuple[int, ...]):
    if kind == "torch":
        torch = _torch()
        out = torch.empty(shape, dtype=torch.float32)
        return out, dlpack_capsule(out)
    import numpy as np

    out = np.empty(shape, dtype=np.float32)
    return out, out


def _run_backward(fn, q, k, v, do, recipe, is_causal, scale, layout, return_forward):
    layout = _layout(layout)
    if not isinstance(is_causal, bool):
        raise argument_error("is_causal", f"must be a bool (got {type(is_causal).__name__})")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise argument_error("scale", f"must be a float or None (got {type(scale).__name__})")
    kind = "torch" if _is_torch(q) else "numpy" if _is_numpy(q) else None
    if kind is None:
        raise argument_error("q", "must be a NumPy array or a CPU torch tensor "
                             f"(got {type(q).__name__})")
    named = {"q": q, "k": k, "v": v, "do": do}
    for name, x in named.items():
        if not (_is_torch(x) if kind == "torch" else _is_numpy(x)):
            raise argument_error(name, f"must be a {'torch tensor' if kind == 'torch' else 'NumPy array'} "
                                 f"like q (got {type(x).__name__})")
        if x.ndim != 4:
            raise argument_error(name, f"must have 4 dimensions (layout {layout}) (got {x.ndim})")
    q_shape = tuple(int(s) for s in q.shape)
    kv_shape = tuple(int(s) for s in k.shape)
    dq, dq_arg = _new_float32(kind, q_shape)
    dk, dk_arg = _new_float32(kind, kv_shape)
    dv, dv_arg = _new_float32(kind, kv_shape)
    out = lse = out_arg = lse_arg = None
    if return_forward:
        out, out_arg = _new_float32(kind, q_shape)
        lse, lse_arg = _new_float32(kind, _lse_shape(q_shape, layout))
    conv = {n: _host_capsule(x, n) for n, x in named.items()} if kind == "torch" else named
    fn(conv["q"], conv["k"], conv["v"], conv["do"], dq_arg, dk_arg, dv_arg, out_arg, lse_arg,
       layout=layout, causal=is_causal, sm_scale=None if scale is None else float(scale),
       recipe=recipe)
    return (dq, dk, dv, out, lse) if return_forward else (dq, dk, dv)


def simulate_backward(q, k, v, do, recipe: RecipeLike = "sagebwd", is_causal: bool = False,
                      scale: Optional[float] = None, layout: str = "HND",
                      return_forward: bool = False):
    """The gradients of attention as the recipe's training kernels compute them, on the CPU.

    q, k, v: NumPy arrays or CPU torch tensors, float16/bfloat16 (float32 allowed), as for
    simulate; do: the gradient of the output, q's shape and dtype. recipe: one with a
    backward ("sagebwd", or e.g. "sagebwd,dp_format=int8" for the paper's INT8-dP ablation).
    Runs the recipe's forward (simulate's, bit for bit) and its backward, and returns float32
    (dq, dk, dv) of q's, k's and v's shapes (dk, dv summed over the query heads that share a
    K/V head); with return_forward=True also the forward's output and LSE.
    """
    return _run_backward(_C.simulate_backward, q, k, v, do, recipe, is_causal, scale, layout,
                         return_forward)


def exact_backward(q, k, v, do, is_causal: bool = False, scale: Optional[float] = None,
                   layout: str = "HND", return_forward: bool = False):
    """The gradients of attention in float64 on the CPU, returned as float32 (arguments as
    simulate_backward, without a recipe)."""
    return _run_backward(_C.exact_backward, q, k, v, do, "sage2_8b", is_causal, scale, layout,
                         return_forward)


# ---- packed variable-length batches ---------------------------------------------------------

def _checked_max_seqlen(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise argument_error(name, f"must be an int, at least the longest sequence "
                             f"(got {type(value).__name__})")
    return int(value)


def checked_varlen_options(dropout_p: Any, causal: Any, window_size: Any, softmax_scale: Any,
                           max_seqlen_q: Any, max_seqlen_k: Any):
    """The options of a varlen call, checked under FlashAttention's names:
    (max_seqlen_q, max_seqlen_k, window_left, window_right, scale)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise argument_error("dropout_p", f"must be 0.0: sagekit's attention has no dropout "
                             f"(got {dropout_p!r})")
    if not isinstance(causal, bool):
        raise argument_error("causal", f"must be a bool (got {type(causal).__name__})")
    left, right = checked_window(window_size, causal)
    scale = checked_scale(softmax_scale, "softmax_scale")
    return (_checked_max_seqlen(max_seqlen_q, "max_seqlen_q"),
            _checked_max_seqlen(max_seqlen_k, "max_seqlen_k"), left, right, scale)


def _run_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, return_lse, recipe):
    max_q, max_k, left, right, scale = checked_varlen_options(
        dropout_p, causal, window_size, softmax_scale, max_seqlen_q, max_seqlen_k)
    kind = _input_kind(q)
    named = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    _require_kind(kind, named)
    if q.ndim != 3:
        raise argument_error("q", f"must have 3 dimensions [total_q, heads_q, head_dim] (got {q.ndim})")
    total_q, heads_q = int(q.shape[0]), int(q.shape[1])
    # The output has V's head dim (the library checks v itself).
    dv = int(v.shape[-1]) if getattr(v, "ndim", 0) == 3 else int(q.shape[-1])
    out, out_arg = _new_float32(kind, (total_q, heads_q, dv))
    lse, lse_arg = _new_float32(kind, (heads_q, total_q)) if return_lse else (None, None)
    conv = {n: _host_capsule(x, n) for n, x in named.items()} if kind == "torch" else named
    fn(conv["q"], conv["k"], conv["v"], conv["cu_seqlens_q"], conv["cu_seqlens_k"], max_q, max_k,
       out_arg, lse_arg, causal=causal, window_left=left, window_right=right, sm_scale=scale,
       recipe=recipe)
    return (out, lse) if return_lse else out


def simulate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), *,
                    recipe: RecipeLike = "sage2_8b", return_lse: bool = False):
    """simulate on a packed batch of variable-length sequences, with the arguments of
    FlashAttention's flash_attn_varlen_func (its positional order too).

    q: [total_q, heads_q, head_dim], k, v: [total_k, heads_kv, head_dim], float16/bfloat16
    NumPy arrays or CPU torch tensors; cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] offsets
    of each sequence's first token (0 first, the token counts last), the same kind as q;
    max_seqlen_q, max_seqlen_k: at least the longest sequence. Each sequence is its own
    attention problem: causal and window_size are aligned bottom-right per sequence, and
    every statistic the recipe takes over tokens is taken over that sequence only, so the
    result for one sequence does not depend on its neighbours, bit for bit. Returns float32
    out of q's shape (and with return_lse=True the natural-log LSE, [heads_q, total_q]);
    a sequence with queries and no key gets 0 and an LSE of -inf.
    """
    if isinstance(recipe, str) and recipe == "auto":
        recipe = "sage2_8b_balanced"
    return _run_varlen(_C.simulate_varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, dropout_p, softmax_scale, causal, window_size, return_lse,
                       recipe)


def exact_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                 dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                 causal: bool = False, window_size: Tuple[int, int] = (-1, -1), *,
                 return_lse: bool = False):
    """Attention in float64 on each sequence of a packed batch, returned as float32
    (arguments as simulate_varlen, without a recipe)."""
    return _run_varlen(_C.exact_varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, dropout_p, softmax_scale, causal, window_size, return_lse,
                       "sage2_8b")
