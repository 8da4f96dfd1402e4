"""sageattn_varlen: the GPU front end of packed variable-length batches, as an API only.

No sm_90 kernel for packed batches exists yet, so sageattn_varlen raises the library's own
refusal (ArgumentError, argument 'cu_seqlens_q') on every call, in every build, with or
without torch. It exists so that code ported from flash_attn_varlen_func finds the name and
learns why it does not run, instead of a silent fallback. The CPU references run packed
batches today: sagekit.simulate_varlen (the recipe, bit for bit) and sagekit.exact_varlen.
"""

from typing import Optional, Tuple

from . import _C
from ._recipes import RecipeLike


def sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), *,
                    recipe: RecipeLike = "auto", return_lse: bool = False):
    """Quantized attention on a packed batch on the GPU, with flash_attn_varlen_func's
    arguments (q, k, v: [total_tokens, heads, head_dim]; cu_seqlens_q/_k: int32 [batch + 1]).

    Not implemented on the GPU yet: always raises ArgumentError('cu_seqlens_q: packed
    variable-length batches have no sm_90 kernel yet; ...'). Use simulate_varlen on the CPU.
    """
    _C.attention_varlen()
    raise AssertionError("unreachable: attention_varlen refuses every call")
