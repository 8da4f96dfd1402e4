"""sagekit.distributed on the CPU: the ring's LSE merge with the recipe's own quantization per
K/V chunk (sagekit.simulate, bit for bit the GPU kernel's), and the adapters' refusals.

The multi-GPU runs (torchrun, NCCL) are the GPU session's: docs/distributed.md.
"""

import enum
import importlib.util

import pytest

import sagekit
from conftest import (HAS_TORCH, attention_f64, check_argument_error, needs_numpy, needs_torch,
                      random_qkv, rel_l1)
from sagekit import distributed

HAS_YUNCHANG = HAS_TORCH and importlib.util.find_spec("yunchang") is not None
HAS_DIFFUSERS = HAS_TORCH and importlib.util.find_spec("diffusers") is not None
needs_yunchang = pytest.mark.skipif(not HAS_YUNCHANG, reason="needs torch and yunchang")
needs_diffusers = pytest.mark.skipif(not HAS_DIFFUSERS, reason="needs torch and diffusers")

# Measured on this suite's inputs (sage2_8b, 256 tokens): the merged error against float64 is
# 0.926x to 1.012x the single call's (docs/distributed.md); the GPU bar of issue 37 is 1.1x.
RATIO_BOUND = 1.1


def owned_tokens(n, ranks, order):
    """Each rank's token indices: contiguous chunks, or zig-zag (rank r holds chunks r and
    2R-1-r of 2R, the load-balanced causal order of yunchang's zigzag ring)."""
    import numpy as np

    if order == "zigzag":
        chunks = np.array_split(np.arange(n), 2 * ranks)
        return [np.concatenate([chunks[r], chunks[2 * ranks - 1 - r]]) for r in range(ranks)]
    return np.array_split(np.arange(n), ranks)


def ring_blocks(owned, r, j, order, causal):
    """(query tokens, key tokens, causal) rank r computes with rank j's K/V, or None: the
    blocks yunchang's basic and zigzag rings ask their kernel for."""
    qi, kj = owned[r], owned[j]
    if not causal or j == r:
        return qi, kj, causal
    if order != "zigzag":
        return (qi, kj, False) if j < r else None
    if j < r:  # the earlier half of rank j's keys precedes every query of rank r
        return qi, kj[: len(kj) // 2], False
    return qi[len(qi) // 2:], kj, False  # only rank r's later half follows all of rank j's keys


def ring_attention(q, k, v, ranks, order, causal, attend):
    """Ring attention on one machine: each rank's blocks through `attend` (each call with its
    own quantization statistics, as a ring step has), merged with merge_partial_attention."""
    import numpy as np

    owned = owned_tokens(q.shape[2], ranks, order)
    out = np.zeros(q.shape, np.float32)
    for r, qi in enumerate(owned):
        outs, lses = [], []
        for j in range(ranks):
            block = ring_blocks(owned, r, j, order, causal)
            if block is None:
                continue
            qs, ks, block_causal = block
            o, lse = attend(q[:, :, qs], k[:, :, ks], v[:, :, ks], block_causal)
            # A block covering part of rank r's queries: the others see no key in it.
            rows = np.searchsorted(qi, qs)
            full_o = np.zeros(q.shape[:2] + (len(qi), q.shape[3]), np.float32)
            full_lse = np.full(q.shape[:2] + (len(qi),), -np.inf, np.float32)
            full_o[:, :, rows], full_lse[:, :, rows] = o, lse
            outs.append(full_o)
            lses.append(full_lse)
        out[:, :, qi] = distributed.merge_partial_attention(outs, lses)[0]
    return out


def simulate_block(recipe):
    return lambda q, k, v, causal: sagekit.simulate(q, k, v, recipe=recipe, is_causal=causal,
                                                    return_lse=True)


def test_import_needs_no_torch_nor_engines():
    # The module imports the engines (and torch) only inside the adapters.
    assert callable(distributed.merge_partial_attention)
    assert distributed.YUNCHANG_VERSION == "0.6.4" and distributed.DIFFUSERS_VERSION == "0.42.1"


@needs_numpy
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("order,causal", [("contiguous", False), ("contiguous", True),
                                          ("zigzag", True)])
def test_merge_of_exact_blocks_is_exact(ranks, order, causal):
    q, k, v = random_qkv((1, 2, 192, 64), (1, 2, 192, 64), seed=3)
    ref, _ = attention_f64(q, k, v, causal=causal)
    exact = lambda q, k, v, c: sagekit.exact(q, k, v, is_causal=c, return_lse=True)
    merged = ring_attention(q, k, v, ranks, order, causal, exact)
    assert rel_l1(merged, ref) < 1e-6


@needs_numpy
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("order,causal", [("contiguous", False), ("contiguous", True),
                                          ("zigzag", True)])
def test_ring_of_quantized_blocks_keeps_the_single_call_error(d, heads, ranks, order, causal):
    import numpy as np

    hq, hkv = heads
    q, k, v = random_qkv((1, hq, 256, d), (1, hkv, 256, d), seed=d + 10 * hq + ranks)
    ref, _ = attention_f64(q, k, v, causal=causal)
    single = sagekit.simulate(q, k, v, recipe="sage2_8b", is_causal=causal)
    merged = ring_attention(q, k, v, ranks, order, causal, simulate_block("sage2_8b"))
    assert np.isfinite(merged).all()
    single_err, merged_err = rel_l1(single, ref), rel_l1(merged, ref)
    print(f"d={d} heads={heads} ranks={ranks} {order} causal={causal}: single {single_err:.4e} "
          f"merged {merged_err:.4e} ratio {merged_err / single_err:.3f}")
    assert merged_err <= RATIO_BOUND * single_err


@needs_numpy
def test_merge_lse_and_layouts():
    import numpy as np

    q, k, v = random_qkv((2, 3, 40, 64), (2, 3, 96, 64), seed=5)
    out, lse = sagekit.exact(q, k, v, return_lse=True)
    parts = [sagekit.exact(q, k[:, :, s], v[:, :, s], return_lse=True)
             for s in (slice(0, 30), slice(30, 96))]
    merged, merged_lse = distributed.merge_partial_attention([p[0] for p in parts],
                                                             [p[1] for p in parts])
    assert merged.dtype == np.float32 and merged_lse.dtype == np.float32
    np.testing.assert_allclose(merged, out, atol=2e-6)
    np.testing.assert_allclose(merged_lse, lse, atol=2e-5)
    nhd, _ = distributed.merge_partial_attention([p[0].transpose(0, 2, 1, 3) for p in parts],
                                                 [p[1] for p in parts], layout="NHD")
    np.testing.assert_allclose(nhd, out.transpose(0, 2, 1, 3), atol=2e-6)


@needs_numpy
def test_merge_of_rows_that_see_no_key():
    import numpy as np

    out = np.ones((1, 1, 2, 4), np.float32)
    lse = np.array([[[-np.inf, 0.5]]], np.float32)
    empty_lse = np.full((1, 1, 2), -np.inf, np.float32)
    merged, merged_lse = distributed.merge_partial_attention([out, 2 * out], [lse, empty_lse])
    assert (merged[0, 0, 0] == 0).all() and merged_lse[0, 0, 0] == -np.inf
    np.testing.assert_allclose(merged[0, 0, 1], 1.0)
    assert merged_lse[0, 0, 1] == np.float32(0.5)


@needs_numpy
def test_merge_argument_errors():
    import numpy as np

    x, lse = np.zeros((1, 1, 2, 4), np.float32), np.zeros((1, 1, 2), np.float32)
    check_argument_error("lses", distributed.merge_partial_attention, [x, x], [lse])
    check_argument_error("lses", distributed.merge_partial_attention, [], [])
    check_argument_error("layout", distributed.merge_partial_attention, [x], [lse], layout="BSHD")


def test_extend_str_enum_behaves_like_a_declared_member():
    # diffusers' AttentionBackendName is a (str, Enum); the shim must make a new name pass
    # every check diffusers applies: value lookup, __members__, isinstance and .value.
    class Names(str, enum.Enum):
        NATIVE = "native"

    member = distributed._extend_str_enum(Names, "SAGEKIT", "sagekit")
    assert Names("sagekit") is member and isinstance(member, Names)
    assert member.value == "sagekit" and member.name == "SAGEKIT" and member == "sagekit"
    assert "sagekit" in {x.value for x in Names.__members__.values()}
    assert list(Names) == [Names.NATIVE, member] and Names.SAGEKIT is member
    assert distributed._extend_str_enum(Names, "SAGEKIT", "sagekit") is member
    assert {member: 1}[Names("sagekit")] == 1


# ---- the adapters' refusals: they run before any kernel, so CPU tensors serve ----------------

def _nhd(heads_q=4, heads_kv=4):
    import torch

    q = torch.zeros(1, 8, heads_q, 64, dtype=torch.float16)
    kv = torch.zeros(1, 8, heads_kv, 64, dtype=torch.float16)
    return q, kv, kv.clone()


@needs_torch
@pytest.mark.parametrize("argument,kwargs", [
    ("dropout_p", {"dropout_p": 0.1}),
    ("window_size", {"window_size": (16, 0)}),
    ("softcap", {"softcap": 30.0}),
    ("alibi_slopes", {"alibi_slopes": object()}),
    ("return_softmax", {"return_softmax": True}),
    ("return_attn_probs", {"return_attn_probs": True}),
    ("deterministic", {"deterministic": "yes"}),
])
def test_yunchang_attention_refuses_by_name(argument, kwargs):
    check_argument_error(argument, distributed.yunchang_attention, *_nhd(), **kwargs)


@needs_torch
def test_yunchang_attention_takes_the_positional_order_of_the_zigzag_ring():
    # zigzag and stripe pass (q, k, v, dropout_p, softmax_scale, causal=...): a dropout in
    # the fourth place must be read as dropout_p.
    check_argument_error("dropout_p", distributed.yunchang_attention, *_nhd(), 0.1, None, causal=True)


@needs_torch
def test_yunchang_attention_reaches_the_kernel_with_its_arguments():
    # On a CPU tensor the kernel's own device check answers, so everything before it passed.
    message = check_argument_error("q", distributed.yunchang_attention, *_nhd(), 0.0, 0.125,
                                   causal=True, softcap=0.0, deterministic=True)
    assert "CUDA" in message


@needs_torch
@pytest.mark.parametrize("argument,kwargs", [
    ("attn_mask", {"attn_mask": object()}),
    ("dropout_p", {"dropout_p": 0.1}),
])
def test_diffusers_attention_refuses_by_name(argument, kwargs):
    check_argument_error(argument, distributed.diffusers_attention, *_nhd(), **kwargs)


@needs_torch
def test_diffusers_attention_needs_enable_gqa_for_different_head_counts():
    check_argument_error("enable_gqa", distributed.diffusers_attention, *_nhd(4, 2))


@needs_torch
@pytest.mark.parametrize("argument,kwargs", [
    ("is_causal", {"is_causal": True}),
    ("enable_gqa", {"enable_gqa": True}),
    ("window_size", {"window_size": (64, 64)}),
])
def test_diffusers_context_parallel_refusals(argument, kwargs):
    check_argument_error(argument, distributed.diffusers_attention, *_nhd(),
                         _parallel_config=object(), **kwargs)


@needs_torch
def test_diffusers_backward_is_refused_by_name():
    check_argument_error("requires_grad", distributed._diffusers_backward_op, None, None)


@needs_yunchang
def test_yunchang_shim_resolves_only_sagekit_and_only_forward():
    import yunchang.ring.zigzag_ring_flash_attn as zigzag

    distributed._install_yunchang_shim()
    distributed._install_yunchang_shim()  # idempotent: one wrapper
    select = zigzag.select_flash_attn_impl
    assert select._sagekit_shim and not getattr(select.__wrapped__, "_sagekit_shim", False)
    attn_type = distributed.SagekitAttnType("sage2_8b")
    assert select(attn_type, stage="fwd-only") == attn_type.kernel
    check_argument_error("attn_type", select, attn_type, "bwd-only")


@needs_yunchang
def test_yunchang_layer_refuses_other_ring_kernels():
    check_argument_error("ring_impl_type", distributed.yunchang_long_context_attention,
                         ring_impl_type="basic_pytorch")
    check_argument_error("attn_type", distributed.yunchang_long_context_attention, attn_type=1)


@needs_diffusers
def test_diffusers_registration():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    assert distributed.register_diffusers_backend("sagekit", recipe="sage2_8b") == "sagekit"
    backend = AttentionBackendName("sagekit")
    assert _AttentionBackendRegistry._is_context_parallel_available(backend)
    assert {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "return_lse",
            "_parallel_config", "window_size"} <= _AttentionBackendRegistry._supported_arg_names[backend]
    distributed.register_diffusers_backend("sagekit", recipe="sage2_8b_balanced")  # again: fine
    check_argument_error("name", distributed.register_diffusers_backend, "native")
