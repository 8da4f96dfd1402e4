"""sagekit.compat: the reference SageAttention package's entry points, computed by sagekit.

The mapping from the reference's parameters to a sagekit call is checked on any machine
through sagekit.compat.plan (no torch, no GPU); the GPU test runs the same user code for real
and compares every result with sagekit.sageattn called directly.
"""

import functools
import inspect
import sys
import types

import pytest

import sagekit
from sagekit import compat
from conftest import needs_gpu

np = pytest.importorskip("numpy", reason="needs numpy")

_EMPTY = inspect.Parameter.empty

# The reference package's signatures (sageattention 2.2.0, sageattention/core.py): every
# name, its order and its default. "**" is the **kwargs catch-all.
REFERENCE_SIGNATURES = {
    "sageattn": [("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("tensor_layout", "HND"),
                 ("is_causal", False), ("sm_scale", None), ("return_lse", False), ("**", None)],
    "sageattn_qk_int8_pv_fp16_triton": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("tensor_layout", "HND"),
        ("quantization_backend", "triton"), ("is_causal", False), ("attn_mask", None),
        ("sm_scale", None), ("smooth_k", True), ("return_lse", False), ("**", None)],
    "sageattn_qk_int8_pv_fp16_cuda": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("tensor_layout", "HND"),
        ("is_causal", False), ("qk_quant_gran", "per_thread"), ("sm_scale", None),
        ("pv_accum_dtype", "fp32"), ("smooth_k", True), ("smooth_v", False),
        ("return_lse", False), ("**", None)],
    "sageattn_qk_int8_pv_fp8_cuda": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("tensor_layout", "HND"),
        ("is_causal", False), ("qk_quant_gran", "per_thread"), ("sm_scale", None),
        ("pv_accum_dtype", "fp32+fp16"), ("smooth_k", True), ("smooth_v", False),
        ("return_lse", False), ("**", None)],
    "sageattn_qk_int8_pv_fp8_cuda_sm90": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("tensor_layout", "HND"),
        ("is_causal", False), ("qk_quant_gran", "per_thread"), ("sm_scale", None),
        ("pv_accum_dtype", "fp32+fp32"), ("smooth_k", True), ("return_lse", False),
        ("**", None)],
    "sageattn_varlen": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("cu_seqlens_q", _EMPTY),
        ("cu_seqlens_k", _EMPTY), ("max_seqlen_q", _EMPTY), ("max_seqlen_k", _EMPTY),
        ("is_causal", False), ("sm_scale", None), ("smooth_k", True), ("**", None)],
}

# The 4-d entry points (sageattn_varlen takes packed tensors: its own tests below).
ENTRY_POINTS = [name for name in REFERENCE_SIGNATURES if name != "sageattn_varlen"]


@pytest.mark.parametrize("name", sorted(REFERENCE_SIGNATURES))
def test_signatures_are_the_reference_packages(name):
    params = []
    for p in inspect.signature(getattr(compat, name)).parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            params.append(("**", None))
        else:
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, p
            params.append((p.name, p.default))
    assert params == REFERENCE_SIGNATURES[name]


# Code written for the reference package, unchanged: only what `sageattention` is differs.
# Inputs: q, k, v [1, 4, 256, 64] HND with 2 KV heads; *_nhd the same in NHD; q80, k80, v80
# with head dim 80.
REFERENCE_USER_CODE = """
from sageattention import (sageattn, sageattn_qk_int8_pv_fp16_cuda,
                           sageattn_qk_int8_pv_fp16_triton, sageattn_qk_int8_pv_fp8_cuda,
                           sageattn_qk_int8_pv_fp8_cuda_sm90)

results = {}
results["default"] = sageattn(q, k, v)
results["keywords"] = sageattn(q, k, v, tensor_layout="HND", is_causal=True, sm_scale=0.1)
results["positional"] = sageattn(q, k, v, "HND", False, None, True)
results["nhd"] = sageattn(q_nhd, k_nhd, v_nhd, tensor_layout="NHD", is_causal=False)
results["sm90"] = sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="HND", is_causal=False,
                                                     qk_quant_gran="per_warp",
                                                     pv_accum_dtype="fp32+fp32")
results["sm89"] = sageattn_qk_int8_pv_fp8_cuda(q, k, v, is_causal=True, smooth_v=True)
results["triton"] = sageattn_qk_int8_pv_fp16_triton(q, k, v, "HND", "cuda", True)
results["fp16_cuda"] = sageattn_qk_int8_pv_fp16_cuda(q, k, v, pv_accum_dtype="fp16+fp32",
                                                     return_lse=True)
results["head_dim_80"] = sageattn(q80, k80, v80, is_causal=True)
"""


def run_reference_code(monkeypatch, module, tensors):
    monkeypatch.setitem(sys.modules, "sageattention", module)
    namespace = dict(tensors)
    exec(compile(REFERENCE_USER_CODE, "<code written for sageattention>", "exec"), namespace)
    return namespace["results"]


def planning_module():
    """A stand-in `sageattention` whose functions return compat's plan instead of running."""
    module = types.ModuleType("sageattention")
    for name in REFERENCE_SIGNATURES:
        setattr(module, name, functools.partial(compat.plan, getattr(compat, name)))
    return module


def inputs(make):
    """The inputs REFERENCE_USER_CODE reads, from make(shape) -> array."""
    t = {"q": make((1, 4, 256, 64)), "k": make((1, 2, 256, 64)), "v": make((1, 2, 256, 64))}
    t.update({f"{n}_nhd": make((1, 256, t[n].shape[1], 64)) for n in "qkv"})
    t.update({"q80": make((1, 4, 256, 80)), "k80": make((1, 2, 256, 80)),
              "v80": make((1, 2, 256, 80))})
    return t


def sage2_8b_with(**options):
    return dict({"base": "sage2_8b", "qk_granularity": "per_thread", "smooth_k": True,
                 "smooth_v": False}, **options)


def test_reference_code_maps_onto_sagekit_calls(monkeypatch):
    plans = run_reference_code(monkeypatch, planning_module(),
                               inputs(lambda shape: np.zeros(shape, np.float16)))
    C = compat.CompatCall
    # 80 runs as it is where the build takes it (every tile); a build of some tiles pads it.
    padded80 = min(d for d in compat._KERNEL_HEAD_DIMS if d >= 80)
    scale80 = None if padded80 == 80 else 1 / np.sqrt(80)
    assert plans == {
        "default": C("auto", "HND", False, None, False, 64, 64),
        "keywords": C("auto", "HND", True, 0.1, False, 64, 64),
        "positional": C("auto", "HND", False, None, True, 64, 64),
        "nhd": C("auto", "NHD", False, None, False, 64, 64),
        "sm90": C(sage2_8b_with(qk_granularity="per_warp"), "HND", False, None, False, 64, 64),
        "sm89": C(sage2_8b_with(base="sage2pp_8b", smooth_v=True), "HND", True, None, False,
                  64, 64),
        "triton": C({"base": "sage1_b", "smooth_k": True}, "HND", True, None, False, 64, 64),
        "fp16_cuda": C(sage2_8b_with(base="sage1_b"), "HND", False, None, True, 64, 64),
        # A multiple of 8 from 32: the library takes it as it is (issue 34), no copy.
        "head_dim_80": C("auto", "HND", True, scale80, False, 80, padded80),
    }


@pytest.mark.parametrize("call, preset", [
    (lambda q: compat.plan(compat.sageattn_qk_int8_pv_fp8_cuda_sm90, q, q, q), "sage2_8b"),
    (lambda q: compat.plan(compat.sageattn_qk_int8_pv_fp8_cuda, q, q, q), "sage2pp_8b"),
    (lambda q: compat.plan("sageattn_qk_int8_pv_fp8_cuda", q, q, q, pv_accum_dtype="fp32+fp32"),
     "sage2_8b"),
    (lambda q: compat.plan(compat.sageattn_qk_int8_pv_fp16_triton, q, q, q), "sage1_b"),
])
def test_the_defaults_are_the_papers_presets(call, preset):
    q = np.zeros((1, 1, 8, 64), np.float16)
    assert sagekit.recipe(call(q).recipe)["name"] == preset


def accepted_calls():
    """Every accepted combination of each entry point's recipe parameters."""
    q = np.zeros((1, 2, 8, 64), np.float16)
    calls = [("sageattn", {})]
    for smooth_k in (True, False):
        calls.append(("sageattn_qk_int8_pv_fp16_triton", {"smooth_k": smooth_k}))
        for gran in ("per_thread", "per_warp"):
            for smooth_v in (True, False):
                calls.append(("sageattn_qk_int8_pv_fp16_cuda",
                              dict(qk_quant_gran=gran, smooth_k=smooth_k, smooth_v=smooth_v,
                                   pv_accum_dtype="fp16+fp32")))
                for accum in ("fp32+fp32", "fp32+fp16"):
                    calls.append(("sageattn_qk_int8_pv_fp8_cuda",
                                  dict(qk_quant_gran=gran, smooth_k=smooth_k, smooth_v=smooth_v,
                                       pv_accum_dtype=accum)))
            calls.append(("sageattn_qk_int8_pv_fp8_cuda_sm90",
                          dict(qk_quant_gran=gran, smooth_k=smooth_k)))
    return [(name, opts, compat.plan(name, q, q, q, **opts)) for name, opts in calls]


def test_every_accepted_combination_is_a_valid_recipe():
    for name, opts, call in accepted_calls():
        if call.recipe == "auto":
            continue
        r = sagekit.recipe(call.recipe)
        assert r["qk_format"] == "int8", (name, opts)
        assert r["smooth_k"] == opts.get("smooth_k", True), (name, opts)
        assert r["smooth_v"] == opts.get("smooth_v", False), (name, opts)


@pytest.mark.skipif(not sagekit.cuda_built, reason="needs a CUDA build: gpu_supports is False "
                    "for every recipe without kernels")
def test_every_accepted_combination_has_a_gpu_kernel():
    for name, opts, call in accepted_calls():
        recipe = "sage2_8b_balanced" if call.recipe == "auto" else call.recipe
        assert sagekit.gpu_supports(recipe), (name, opts, call.recipe)


def check(argument, fn, *args, **kwargs):
    with pytest.raises(sagekit.ArgumentError) as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_unknown_keywords_raise_type_error_naming_them(name):
    q = np.zeros((1, 1, 8, 64), np.float16)
    for fn in (getattr(compat, name), functools.partial(compat.plan, name)):
        with pytest.raises(TypeError) as info:
            fn(q, q, q, is_casual=True, smoth_k=False)
        assert f"{name}()" in str(info.value)
        assert "'is_casual', 'smoth_k'" in str(info.value)


def test_unsupported_values_are_refused_by_parameter():
    q = np.zeros((1, 1, 8, 64), np.float16)
    fp16_cuda, fp8_cuda = compat.sageattn_qk_int8_pv_fp16_cuda, compat.sageattn_qk_int8_pv_fp8_cuda
    sm90, triton = compat.sageattn_qk_int8_pv_fp8_cuda_sm90, compat.sageattn_qk_int8_pv_fp16_triton
    # The reference default of the FP16 CUDA kernel has no sagekit kernel: named, with the way out.
    msg = check("pv_accum_dtype", fp16_cuda, q, q, q)
    assert "'fp32'" in msg and "fp16+fp32" in msg
    check("pv_accum_dtype", fp16_cuda, q, q, q, pv_accum_dtype="fp16")
    assert "fp32+fp32" in check("pv_accum_dtype", fp8_cuda, q, q, q, pv_accum_dtype="fp32")
    check("pv_accum_dtype", sm90, q, q, q, pv_accum_dtype="fp32")
    check("pv_accum_dtype", sm90, q, q, q, pv_accum_dtype="fp32+fp16")
    check("qk_quant_gran", sm90, q, q, q, qk_quant_gran="per_block")
    check("tensor_layout", compat.sageattn, q, q, q, tensor_layout="hnd")
    check("attn_mask", triton, q, q, q, attn_mask=np.ones((8, 8), bool))
    check("quantization_backend", triton, q, q, q, quantization_backend="tvm")
    check("sm_scale", compat.sageattn, q, q, q, sm_scale=0.0)
    check("sm_scale", compat.sageattn, q, q, q, sm_scale=float("inf"))
    check("is_causal", compat.sageattn, q, q, q, is_causal=1)
    check("return_lse", compat.sageattn, q, q, q, return_lse="yes")
    check("smooth_k", sm90, q, q, q, smooth_k=None)
    largest = compat._KERNEL_HEAD_DIMS[-1]   # the build's largest head dim (128 or 256)
    big = np.zeros((1, 1, 8, largest + 8), np.float16)
    assert f"from 1 to {largest}" in check("q", compat.sageattn, big, big, big)
    check("function", compat.plan, "sageattn_fp4", q, q, q)


def test_varlen_maps_onto_the_packed_path():
    q = np.zeros((300, 4, 64), np.float16)  # a tile of every build
    call = compat.plan(compat.sageattn_varlen, q, q, q, None, None, 200, 200, is_causal=True)
    assert call.recipe == {"base": "sage1_b", "smooth_k": True}
    assert call.layout == "packed" and call.is_causal and call.scale is None
    assert (call.head_dim, call.padded_head_dim) == (64, 64)
    odd = np.zeros((300, 4, 20), np.float16)  # below the smallest head dim: padded, own scale
    call = compat.plan("sageattn_varlen", odd, odd, odd, None, None, 8, 8, smooth_k=False,
                       sm_scale=None)
    assert call.recipe["smooth_k"] is False and call.padded_head_dim == 32
    assert call.scale == pytest.approx(1 / np.sqrt(20))
    check("q", compat.plan, compat.sageattn_varlen, np.zeros((1, 300, 4, 72)), q, q, None, None, 8, 8)
    check("smooth_k", compat.plan, compat.sageattn_varlen, q, q, q, None, None, 8, 8, smooth_k=1)
    with pytest.raises(TypeError, match="window_size"):
        compat.plan(compat.sageattn_varlen, q, q, q, None, None, 8, 8, window_size=(4, 0))


@needs_gpu
def test_reference_code_runs_through_compat_on_the_gpu(monkeypatch):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = inputs(lambda shape: torch.randn(shape, generator=gen, device="cuda",
                                               dtype=torch.float16))
    results = run_reference_code(monkeypatch, compat, tensors)
    plans = run_reference_code(monkeypatch, planning_module(), tensors)
    for key, got in results.items():
        call = plans[key]
        suffix = "_nhd" if call.layout == "NHD" else "80" if call.head_dim == 80 else ""
        q, k, v = (tensors[n + suffix] for n in "qkv")
        pad = call.padded_head_dim - call.head_dim
        padded = [torch.nn.functional.pad(t, (0, pad)) for t in (q, k, v)]
        want = sagekit.sageattn(*padded, is_causal=call.is_causal, scale=call.scale,
                                layout=call.layout, recipe=call.recipe,
                                return_lse=call.return_lse)
        if call.return_lse:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), key
            got = got[0]
        else:
            assert torch.equal(got, want[..., :call.head_dim]), key
        # And against float attention: the compat call computes what it says.
        qh, kh, vh = ((t.transpose(1, 2) if call.layout == "NHD" else t).float() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qh, kh.repeat_interleave(2, 1), vh.repeat_interleave(2, 1), is_causal=call.is_causal,
            scale=call.scale)
        out = (got.transpose(1, 2) if call.layout == "NHD" else got).float()
        cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
        assert cos > 0.99, (key, float(cos))


@needs_gpu
def test_varlen_runs_the_packed_kernel_on_the_gpu():
    import torch

    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = [37, 300, 1, 129]
    total = sum(lengths)
    q, k, v = (torch.randn((total, h, 64), generator=gen, device="cuda", dtype=torch.float16)
               for h in (4, 2, 2))
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device="cuda")
    got = compat.sageattn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    want = sagekit.sageattn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                   recipe={"base": "sage1_b", "smooth_k": True})
    assert torch.equal(got, want)
    for b in range(len(lengths)):
        s = slice(int(cu[b]), int(cu[b + 1]))
        qs, ks, vs = (t[s].transpose(0, 1).float() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qs, ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0), is_causal=True)
        cos = torch.nn.functional.cosine_similarity(got[s].transpose(0, 1).float().flatten(),
                                                    ref.flatten(), dim=0)
        assert cos > 0.99, (b, float(cos))
