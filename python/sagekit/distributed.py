"""sagekit as the attention kernel of the sequence-parallel engines people already run.

Nothing here distributes anything: the engines do (all-to-all over heads for Ulysses, K/V
chunks around a ring, both for USP). This module gives each engine the kernel function it
calls, with its argument names and its LSE layout, and refuses by name every argument that
sagekit cannot honor, instead of dropping it. docs/distributed.md says which engine version
each adapter was read against and how each plugs in.

- yunchang (LongContextAttention: Ulysses, ring, USP): `yunchang_attention` is the per-block
  forward function its ring loop calls; `yunchang_long_context_attention` builds the layer.
- diffusers (attention dispatcher, context parallelism): `diffusers_attention` is the backend
  function and `register_diffusers_backend` makes `model.set_attention_backend("sagekit")`
  and `model.enable_parallelism(...)` accept it.
- `merge_partial_attention`: the ring step's combination of partial outputs through their
  LSE, for NumPy arrays or torch tensors (the tests use it on the CPU references).

Importing this module needs neither torch nor the engines; each adapter imports what it
uses when called. The adapters are for inference: they have no backward (training through
sagekit is the single-GPU sageattn(..., recipe="sagebwd"); a ring backward would also need the
LSE's gradient, which sagekit's backward does not take).
"""

import sys
from typing import Any, Callable, Optional, Sequence, Tuple

from ._errors import argument_error
from ._recipes import RecipeLike

__all__ = ["merge_partial_attention", "yunchang_attention", "yunchang_long_context_attention",
           "diffusers_attention", "register_diffusers_backend", "SagekitAttnType"]

# The versions whose source the adapters were written against (docs/distributed.md).
YUNCHANG_VERSION = "0.6.4"
DIFFUSERS_VERSION = "0.42.1"


# ---- merging partial results ---------------------------------------------------------------

def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _lse_as_out(lse, layout: str):
    """An LSE [B, H, N] shaped to broadcast against an output of `layout`."""
    return lse[..., None] if layout == "HND" else lse.swapaxes(1, 2)[..., None]


def merge_partial_attention(outs: Sequence[Any], lses: Sequence[Any], layout: str = "HND"):
    """Combines attention over disjoint key sets into attention over their union.

    outs[i] is softmax attention of the same queries over key set i, [B, H, N, D] ("HND")
    or [B, N, H, D] ("NHD"); lses[i] its natural-log sum of exp, [B, H, N] in both layouts
    (sagekit's). Returns (out, lse) in float32, NumPy or torch like the inputs:
    out = sum_i exp(lse_i - lse) out_i with lse = log(sum_i exp(lse_i)), computed after
    subtracting the largest lse_i so that no exp overflows. A row that sees no key in any
    set (every lse_i = -inf) gets 0 and -inf, sagekit's convention for an empty row.
    """
    if not isinstance(layout, str) or layout.upper() not in ("HND", "NHD"):
        raise argument_error("layout", f"must be 'HND' or 'NHD' (got {layout!r})")
    if len(outs) == 0 or len(outs) != len(lses):
        raise argument_error("lses", f"need one LSE per partial output and at least one "
                             f"(got {len(outs)} outputs, {len(lses)} LSEs)")
    if _is_torch(outs[0]):
        return _merge_torch(outs, lses, layout.upper())
    return _merge_numpy(outs, lses, layout.upper())


def _merge_numpy(outs, lses, layout):
    import numpy as np

    lse = np.stack([np.asarray(x, dtype=np.float32) for x in lses])
    out = np.stack([np.asarray(x, dtype=np.float32) for x in outs])
    top = lse.max(axis=0)
    top = np.where(np.isfinite(top), top, np.float32(0))   # an empty row: every weight 0
    weight = np.exp(lse - top)
    total = weight.sum(axis=0)
    shaped = [_lse_as_out(w, layout) for w in weight]
    merged = sum(w * o for w, o in zip(shaped, out))
    denom = _lse_as_out(total, layout)
    merged = np.where(denom > 0, merged / np.where(denom > 0, denom, 1), np.float32(0))
    with np.errstate(divide="ignore"):
        merged_lse = np.where(total > 0, top + np.log(total), -np.inf).astype(np.float32)
    return merged.astype(np.float32), merged_lse


def _merge_torch(outs, lses, layout):
    import torch

    lse = torch.stack([x.float() for x in lses])
    out = torch.stack([x.float() for x in outs])
    top = lse.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(lse - top)
    total = weight.sum(dim=0)
    merged = sum(_lse_as_out(w, layout) * o for w, o in zip(weight, out))
    denom = _lse_as_out(total, layout)
    merged = torch.where(denom > 0, merged / denom.clamp_min(torch.finfo(torch.float32).tiny),
                         torch.zeros_like(merged))
    merged_lse = torch.where(total > 0, top + torch.log(total),
                             torch.full_like(total, float("-inf")))
    return merged, merged_lse


# ---- refusals shared by the adapters -------------------------------------------------------

def _refuse_dropout(dropout_p: Any) -> None:
    if dropout_p not in (0, 0.0, None):
        raise argument_error("dropout_p", f"sagekit has no attention dropout; pass 0.0 (got "
                             f"{dropout_p}; engines pass it in training mode, and sagekit's "
                             "sequence-parallel adapters have no backward anyway)")


def _refuse_window(window_size: Any) -> None:
    # A ring step sees its K/V chunk at chunk-local positions, so a window (which sagekit
    # would align to the chunk) would mask the wrong keys; refused rather than misapplied.
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise argument_error("window_size", "a sliding window is not supported through the "
                             "sequence-parallel adapters (a ring step sees chunk-local "
                             f"positions); pass (-1, -1) (got {tuple(window_size)!r})")


def _checked_recipe(recipe: RecipeLike) -> RecipeLike:
    from ._recipes import recipe_key

    # Checks the type here (an ArgumentError naming `recipe`); a recipe's name and options
    # are checked by the library when the attention runs, as for sagekit.sageattn.
    recipe_key(recipe)
    return recipe


# ---- yunchang ------------------------------------------------------------------------------

def yunchang_attention(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                       causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                       softcap: Optional[float] = None, alibi_slopes=None,
                       return_softmax: bool = False, *, deterministic: bool = False,
                       return_attn_probs: bool = False, recipe: RecipeLike = "auto"):
    """One attention block as yunchang's ring loop calls it (its "fwd-only" kernels).

    q [B, Nq, Hq, D], k/v [B, Nkv, Hkv, D] (yunchang's layout, sagekit's "NHD"), float16
    or bfloat16 CUDA tensors, Hq a multiple of Hkv. Returns (out [B, Nq, Hq, D] in q's
    dtype, lse [B, Hq, Nq] float32 natural log), the pair yunchang's update_out_and_lse
    merges. The arguments are yunchang 0.6.4's, in its positional order (its zigzag and
    stripe rings pass dropout_p and softmax_scale by position). Honored: softmax_scale
    (None: 1/sqrt(D)), causal (aligned bottom-right, flash-attn's convention; yunchang asks
    for it only on blocks with Nq == Nkv, where both alignments agree), deterministic (the
    forward adds no floating-point values in a run-dependent order). Refused by name:
    dropout_p != 0, a window, softcap != 0, alibi_slopes, return_softmax,
    return_attn_probs. recipe: as in sagekit.sageattn.
    """
    from .attention import sageattn

    _refuse_dropout(dropout_p)
    _refuse_window(window_size)
    if softcap not in (None, 0, 0.0):
        raise argument_error("softcap", f"sagekit has no logit soft-capping; pass 0.0 (got {softcap})")
    if alibi_slopes is not None:
        raise argument_error("alibi_slopes", "sagekit has no ALiBi bias; pass None")
    if return_softmax:
        raise argument_error("return_softmax", "sagekit does not return attention "
                             "probabilities (yunchang asks only when dropout_p > 0)")
    if return_attn_probs:
        raise argument_error("return_attn_probs", "sagekit does not return attention probabilities")
    if not isinstance(deterministic, bool):
        raise argument_error("deterministic", f"must be a bool (got {type(deterministic).__name__})")
    return sageattn(q, k, v, is_causal=causal, scale=softmax_scale, layout="NHD",
                    recipe=recipe, return_lse=True)


class SagekitAttnType:
    """The attn_type yunchang's layers get for sagekit: not one of yunchang's AttnType members,
    so yunchang's kernel selection falls through to the attn_processor it was given (the
    public extension point, used by the "basic" ring); carries the kernel for the shim that
    the "zigzag" and "strip" rings need (they do not forward attn_processor)."""

    def __init__(self, recipe: RecipeLike = "auto"):
        self.recipe = _checked_recipe(recipe)

    def kernel(self, q, k, v, *args, **kwargs):
        return yunchang_attention(q, k, v, *args, recipe=self.recipe, **kwargs)

    def __repr__(self) -> str:
        return f"SagekitAttnType(recipe={self.recipe!r}, forward only)"


# The ring modules that call select_flash_attn_impl without the attn_processor.
_YUNCHANG_SHIM_MODULES = ("yunchang.ring.zigzag_ring_flash_attn", "yunchang.ring.stripe_flash_attn")


def _install_yunchang_shim() -> None:
    """Wraps select_flash_attn_impl in the zigzag and stripe ring modules so that a
    SagekitAttnType resolves to its kernel; every other attn_type goes to yunchang's own
    function unchanged. Idempotent."""
    import importlib

    for name in _YUNCHANG_SHIM_MODULES:
        module = importlib.import_module(name)
        original = getattr(module, "select_flash_attn_impl", None)
        if original is None:
            raise argument_error("ring_impl_type", f"{name} has no select_flash_attn_impl; the "
                                 f"shim was written for yunchang {YUNCHANG_VERSION}")
        if getattr(original, "_sagekit_shim", False):
            continue
        module.select_flash_attn_impl = _shimmed_selector(original)


def _shimmed_selector(original: Callable) -> Callable:
    def select(impl_type, stage="fwd-bwd", attn_processor=None):
        if not isinstance(impl_type, SagekitAttnType):
            return original(impl_type, stage, attn_processor)
        if stage != "fwd-only":
            raise argument_error("attn_type", f"sagekit provides yunchang's forward kernel only "
                                 f"(asked for stage {stage!r}); its sequence-parallel "
                                 "adapters have no backward: run under torch.no_grad()")
        return impl_type.kernel

    select._sagekit_shim = True
    select.__wrapped__ = original
    return select


def yunchang_long_context_attention(ring_impl_type: str = "basic", recipe: RecipeLike = "auto",
                                    **kwargs):
    """yunchang's LongContextAttention (USP: Ulysses x ring, as set by
    yunchang.set_seq_parallel_pg) with sagekit as its attention kernel.

    ring_impl_type "basic" uses yunchang's public extension point (attn_processor with an
    attn_type that is not a yunchang AttnType). "zigzag" and "strip" (the load-balanced
    causal orders) do not forward attn_processor in yunchang 0.6.4, so for them a shim wraps
    the kernel selection of those two ring modules (docs/distributed.md). Other
    ring_impl_types run their own kernels and are refused. kwargs go to
    LongContextAttention (scatter_idx, gather_idx, use_pack_qkv, use_sync); attn_type and
    attn_processor are this function's to set. Forward only.
    """
    from yunchang import LongContextAttention

    for taken in ("attn_type", "attn_processor"):
        if taken in kwargs:
            raise argument_error(taken, "is set by yunchang_long_context_attention to sagekit's kernel")
    if kwargs.get("use_pack_qkv"):
        # yunchang 0.6.4's packed path calls a method that torch tensors do not have.
        raise argument_error("use_pack_qkv", "yunchang's packed-QKV path does not run in "
                             f"{YUNCHANG_VERSION}; pass use_pack_qkv=False")
    if ring_impl_type not in ("basic", "zigzag", "strip"):
        raise argument_error("ring_impl_type", "must be 'basic', 'zigzag' or 'strip' (the "
                             "others run a fixed kernel of their own) "
                             f"(got {ring_impl_type!r})")
    attn_type = SagekitAttnType(recipe)
    if ring_impl_type != "basic":
        _install_yunchang_shim()
    return LongContextAttention(ring_impl_type=ring_impl_type, attn_type=attn_type,
                                attn_processor=attn_type.kernel, **kwargs)


# ---- diffusers -----------------------------------------------------------------------------

def _diffusers_lse(lse):
    """sagekit's LSE [B, H, S] as diffusers' forward ops return it: [B, S, H]."""
    return lse.transpose(1, 2).contiguous()


def _check_diffusers_args(query, key, attn_mask, dropout_p, is_causal, enable_gqa,
                          window_size, parallel) -> None:
    if attn_mask is not None:
        raise argument_error("attn_mask", "sagekit cannot apply an explicit attention mask; "
                             "pass None (is_causal=True gives the causal mask)")
    _refuse_dropout(dropout_p)
    hq, hkv = query.shape[2], key.shape[2]
    if hq != hkv and not enable_gqa:
        raise argument_error("enable_gqa", f"query has {hq} heads and key/value {hkv}; pass "
                             "enable_gqa=True for grouped-query attention")
    if parallel:
        # diffusers' context-parallel template refuses these itself, with a message that does
        # not name the argument; refused here first, by name.
        if is_causal:
            raise argument_error("is_causal", f"diffusers {DIFFUSERS_VERSION}'s context-parallel "
                                 "attention does not support causal masks")
        if enable_gqa:
            raise argument_error("enable_gqa", f"diffusers {DIFFUSERS_VERSION}'s "
                                 "context-parallel attention does not support GQA")
        _refuse_window(window_size)


def _diffusers_forward_op(recipe: RecipeLike) -> Callable:
    """The per-block function diffusers' Ulysses and ring templates call."""
    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                   _parallel_config=None):
        from .attention import sageattn

        _check_diffusers_args(query, key, attn_mask, dropout_p, is_causal, enable_gqa,
                              (-1, -1), parallel=False)
        out = sageattn(query, key, value, is_causal=is_causal, scale=scale, layout="NHD",
                       recipe=recipe, return_lse=return_lse)
        if not return_lse:
            return out
        return out[0], _diffusers_lse(out[1])

    return forward_op


def _diffusers_backward_op(ctx, grad_out, *args, **kwargs):
    raise argument_error("requires_grad", "sagekit's sequence-parallel adapters have no "
                         "backward; run the model under torch.no_grad() or "
                         "torch.inference_mode()")


def diffusers_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: Optional[float] = None,
                        enable_gqa: bool = False, window_size: Tuple[int, int] = (-1, -1),
                        return_lse: bool = False, _parallel_config=None, *,
                        recipe: RecipeLike = "auto"):
    """sagekit as a diffusers attention backend (the function its dispatcher calls).

    query [B, S, Hq, D], key/value [B, S_kv, Hkv, D] (diffusers' layout, sagekit's "NHD"),
    float16/bfloat16 CUDA tensors. Returns out [B, S, Hq, D], and with return_lse also the
    float32 natural-log LSE [B, S, Hq], the layout diffusers' context-parallel templates
    merge. With _parallel_config (set by model.enable_parallelism) the call goes through
    diffusers' own Ulysses / ring / unified template with sagekit as the per-block kernel.
    Honored: scale, is_causal (bottom-right) and window_size without context parallelism,
    enable_gqa (sagekit runs GQA natively). Refused by name: attn_mask, dropout_p != 0,
    different head counts without enable_gqa, and with context parallelism is_causal,
    enable_gqa and a window (diffusers' template supports none of them).
    The dispatcher drops keyword arguments a backend's signature lacks before calling it,
    so an attention_kwargs entry not named here never reaches this function.
    """
    from .attention import sageattn

    parallel = _parallel_config is not None
    _check_diffusers_args(query, key, attn_mask, dropout_p, is_causal, enable_gqa, window_size,
                          parallel)
    if not parallel:
        out = sageattn(query, key, value, is_causal=is_causal, scale=scale, layout="NHD",
                       recipe=recipe, return_lse=return_lse, window_size=tuple(window_size))
        return (out[0], _diffusers_lse(out[1])) if return_lse else out
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(
        query, key, value, None, 0.0, False, scale, False, return_lse,
        forward_op=_diffusers_forward_op(recipe), backward_op=_diffusers_backward_op,
        _parallel_config=_parallel_config)


def _extend_str_enum(enum_cls, member_name: str, value: str):
    """Adds a member to a str-valued Enum class, as if it had been declared there.

    diffusers keeps its backend names in an Enum and checks every name against it
    (set_attention_backend, attention_backend, enable_parallelism), so a new backend needs
    a member. Python has no public way to extend an Enum; this fills the same tables that
    the class statement fills (checked on a stand-in Enum under Python 3.11, 3.12 and 3.13).
    """
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[member_name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(member_name)
    type.__setattr__(enum_cls, member_name, member)
    return member


def _diffusers_backend(recipe: RecipeLike) -> Callable:
    """diffusers_attention with the recipe bound, under the signature the registry reads
    (it passes only the arguments a backend's signature names)."""
    def sagekit_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                        scale=None, enable_gqa=False, window_size=(-1, -1), return_lse=False,
                        _parallel_config=None):
        return diffusers_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa, window_size, return_lse, _parallel_config,
                                   recipe=recipe)

    sagekit_backend._sagekit_recipe = recipe
    return sagekit_backend


def register_diffusers_backend(name: str = "sagekit", recipe: RecipeLike = "auto") -> str:
    """Registers sagekit as diffusers attention backend `name`, with context parallelism.

    Afterwards model.set_attention_backend(name), the attention_backend(name) context and
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=.. or
    ring_degree=..)) accept it. Calling it again re-registers with the new recipe. A name
    that diffusers already uses for another backend is refused. Returns the name.
    Written against diffusers 0.42.1 (docs/distributed.md: a new name needs a member of
    diffusers' AttentionBackendName Enum, which this adds).
    """
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    if not isinstance(name, str) or not name or name != name.lower():
        raise argument_error("name", f"must be a non-empty lower-case string (diffusers "
                             f"lower-cases backend names) (got {name!r})")
    known = AttentionBackendName._value2member_map_.get(name)
    if known is not None and not hasattr(_AttentionBackendRegistry._backends.get(known),
                                         "_sagekit_recipe"):
        raise argument_error("name", f"diffusers already has a backend {name!r}; pick another name")
    backend = _extend_str_enum(AttentionBackendName, name.upper(), name)
    _AttentionBackendRegistry.register(backend, constraints=[], supports_context_parallel=True)(
        _diffusers_backend(_checked_recipe(recipe)))
    return name
