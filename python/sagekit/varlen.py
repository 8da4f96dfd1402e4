"""sageattn_varlen: packed variable-length batches on the GPU, with flash_attn_varlen_func's
arguments (code written for it ports by renaming the function).

The work runs in the custom op torch.ops.sagekit.attention_varlen (ops.py), which never reads
cu_seqlens on the host: torch.compile(fullgraph=True) traces it as one node and a CUDA graph
replays it with new offsets in the same tensors. Every statistic the recipe takes over tokens
(K's mean, V's scales, Q's block means, the channel balance's ranges) is taken per sequence,
and the mask is aligned bottom-right per sequence, so a sequence's output does not depend on
its neighbours. On the CPU, sagekit.simulate_varlen runs the recipe bit for bit and
sagekit.exact_varlen is the float64 reference.
"""

import numbers
from typing import Optional, Tuple

from ._errors import argument_error, checked_scale, checked_window
from ._recipes import RecipeLike, recipe_key


def _checked_max_seqlen(value, name: str):
    # A Python int, or a symbolic one while torch.compile traces with dynamic shapes.
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or
                                       type(value).__name__ == "SymInt"):
        raise argument_error(name, f"must be an int (got {type(value).__name__})")
    return value


def sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), *,
                    recipe: RecipeLike = "auto", return_lse: bool = False):
    """Quantized attention on a packed batch on the GPU, flash_attn_varlen_func's way.

    q: [total_q, heads_q, head_dim], k, v: [total_k, heads_kv, head_dim] CUDA tensors (v may
    have a head dim of its own, as MLA's 192 / 128; out then has it) (fp16 or
    bf16, head_dim contiguous; heads_kv divides heads_q: GQA/MQA). cu_seqlens_q/_k: int32
    [batch + 1] offsets on q's device (sequence b owns tokens cu[b] .. cu[b + 1] - 1); they are
    never read on the host. max_seqlen_q/_k: ints, at least the longest sequence (they size
    the grid and the workspace; a length above them is cut on the device, not read out of
    bounds). causal: bottom-right per sequence; window_size = (left, right), -1 unbounded, per
    sequence. softmax_scale defaults to 1/sqrt(head_dim). dropout_p must be 0.

    Returns out (q's shape with v's head dim, q's dtype), and with return_lse=True also the
    float32 LSE in FlashAttention's packed form [heads_q, total_q]. A sequence with queries and no keys gets
    output 0 and LSE -inf; one without queries writes nothing. No autograd (inference).
    """
    if dropout_p != 0:
        raise argument_error("dropout_p", f"must be 0.0: sagekit has no attention dropout "
                             f"(got {dropout_p!r})")
    try:
        import torch
    except ImportError:  # pragma: no cover - sagekit without torch
        torch = None
    if torch is None or not isinstance(q, torch.Tensor) or not q.is_cuda:
        raise argument_error("q", "sageattn_varlen runs on CUDA tensors (torch); on the CPU, "
                             "sagekit.simulate_varlen runs the recipe bit for bit")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise argument_error(name, f"must be a torch.Tensor (got {type(t).__name__})")
        if t.dim() != 3:
            raise argument_error(name, "must be a 3-d [total_tokens, heads, head_dim] tensor "
                                 f"(got {t.dim()} dimensions)")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise argument_error("q", f"dtype must be torch.float16 or torch.bfloat16 (got {q.dtype})")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise argument_error(name, f"dtype must equal q's {q.dtype} (got {t.dtype})")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise argument_error(name, "must be a 1-d torch.int32 tensor of batch + 1 offsets "
                                 f"(got {getattr(t, 'dtype', type(t).__name__)})")
        if t.device != q.device:
            raise argument_error(name, f"must be on q's device {q.device} (got {t.device}), as "
                                 "flash_attn_varlen_func takes it")
    if not isinstance(causal, bool):
        raise argument_error("causal", f"must be a bool (got {type(causal).__name__})")
    max_q = _checked_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_k = _checked_max_seqlen(max_seqlen_k, "max_seqlen_k")
    left, right = checked_window(window_size, causal)
    scale = checked_scale(softmax_scale, "softmax_scale")
    from . import ops  # registers torch.ops.sagekit.* (needs torch)

    out, lse = ops.call_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                         causal, left, right, scale, recipe_key(recipe),
                                         return_lse)
    return (out, lse) if return_lse else out
