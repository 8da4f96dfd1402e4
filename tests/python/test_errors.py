"""Every bad argument is an ArgumentError (a ValueError) that names the argument."""

import subprocess
import sys

import pytest

import sagekit
from conftest import HAS_TORCH, needs_torch, random_qkv
from conftest import check_argument_error as check

np = pytest.importorskip("numpy", reason="needs numpy")


@pytest.fixture
def qkv():
    return random_qkv((1, 4, 64, 64), (1, 2, 64, 64))


@pytest.mark.parametrize("fn", [sagekit.simulate, sagekit.exact])
def test_wrapper_argument_errors(fn, qkv):
    q, k, v = qkv
    check("q", fn, q[0], k, v)                                  # 3 dimensions
    check("q", fn, q.astype(np.uint8), k, v)                     # dtype the library has no name for
    check("q", fn, q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    check("q", fn, [[1.0]], k, v)                                # not an array
    check("k", fn, q, k[..., :32], v)                            # head_dim differs
    check("k", fn, q, np.concatenate([k, k, k], axis=1), v)      # 3 heads do not divide 4
    check("k", fn, np.concatenate([q, q]), k, v)                 # batch differs
    check("v", fn, q, k, v[:, :, :32])                           # tokens differ
    check("v", fn, q, k, v.astype(np.float32))                   # dtype differs from q
    check("q", fn, np.repeat(q, 2, axis=-1)[..., ::2], k, v)     # head_dim not contiguous
    check("layout", fn, q, k, v, layout="BHSD")
    check("is_causal", fn, q, k, v, is_causal=1)
    check("scale", fn, q, k, v, scale="big")
    # The caller's argument is `scale`; the library's own name (sm_scale) must not leak out.
    check("scale", fn, q, k, v, scale=0.0)
    check("scale", fn, q, k, v, scale=float("nan"))
    check("scale", fn, q, k, v, scale=-1)
    check("window_size", fn, q, k, v, window_size=5)
    check("window_size", fn, q, k, v, window_size=(1, 2, 3))
    check("window_size", fn, q, k, v, window_size=(-2, 0))
    check("window_size", fn, q, k, v, window_size=(4, 1.5))
    check("window_size", fn, q, k, v, window_size=(True, 0))
    assert "is_causal" in check("window_size", fn, q, k, v, is_causal=True, window_size=(8, 3))


@pytest.mark.parametrize("layout, shape", [("HND", (1, 2, 0, 64)), ("NHD", (1, 0, 2, 64)),
                                           ("HND", (0, 2, 5, 64))])
def test_empty_numpy_arrays_are_accepted(layout, shape):
    # NumPy gives empty arrays zero strides; before, the head_dim stride rule refused them.
    a = np.zeros(shape, np.float16)
    assert a.strides == (0, 0, 0, 0)
    for fn in (sagekit.simulate, sagekit.exact):
        out, lse = fn(a, a, a, layout=layout, return_lse=True)
        assert out.shape == shape and lse.size == 0


def test_recipe_errors_through_simulate(qkv):
    q, k, v = qkv
    check("recipe", sagekit.simulate, q, k, v, recipe="sage4")
    check("recipe.pv_accum", sagekit.simulate, q, k, v, recipe={"pv_accum": "fp64"})
    check("recipe.qk_granularity", sagekit.simulate, q, k, v,
          recipe={"base": "sage3_fp4", "qk_granularity": "per_block"})


def test_prequantized_inputs_need_their_scales(qkv):
    q, k, v = qkv
    qi, ki, vi = (x.astype(np.int8) for x in (q, k, v))
    check("q_scale", sagekit.simulate, qi, ki, vi, recipe="int_flash")
    scales = dict(q_scale=np.ones((1, 4, 64), np.float32), k_scale=np.ones((1, 2, 64), np.float32),
                  v_scale=np.ones((1, 2), np.float32))
    check("k_scale", sagekit.simulate, qi, ki, vi, recipe="int_flash",
          **dict(scales, k_scale=np.ones((1, 2, 63), np.float32)))
    msg = check("q", sagekit.simulate, q, k, v, recipe="int_flash", **scales)
    assert "i8" in msg
    out = sagekit.simulate(qi, ki, vi, recipe="int_flash", **scales)
    ref = sagekit.exact(qi, ki, vi, **scales)
    assert out.shape == q.shape and ref.shape == q.shape
    check("q_scale", sagekit.simulate, q, k, v, **scales)  # scales without a prequantized recipe


def test_binding_level_errors(qkv):
    C = sagekit._C
    q, k, v = qkv
    out = np.empty(q.shape, np.float32)
    check("out", C.simulate, q, k, v, None)
    check("out", C.simulate, q, k, v, np.empty((1, 4, 64, 32), np.float32))
    ro = np.empty(q.shape, np.float32)
    ro.setflags(write=False)
    check("out", C.simulate, q, k, v, ro)
    check("lse", C.simulate, q, k, v, out, np.empty((1, 4, 63), np.float32))
    check("lse", C.simulate, q, k, v, out, np.empty((1, 4, 64), np.float64))
    check("q", C.simulate, q.reshape(1, 4, 64, 8, 8), k, v, out)  # more than 4 dimensions
    check("q", C.simulate, q.astype(np.complex64), k, v, out)
    check("q", C.simulate, "q", k, v, out)
    check("layout", C.simulate, q, k, v, out, layout="HDN")
    check("recipe", C.simulate, q, k, v, out, recipe=None)
    check("device", C.check_args, q, k, v, out, device="tpu")
    # The CPU arrays are not GPU memory: the GPU entry points refuse them by name.
    err = check("q" if sagekit.cuda_built else "device", C.workspace_bytes, q, k, v,
                np.empty(q.shape, np.float16))
    assert err


def test_check_args_reports_the_problem(qkv):
    q, k, v = qkv
    p = sagekit._C.check_args(q, k, v, np.empty(q.shape, np.float32), device="cpu", sm_scale=0.5)
    assert p == {"batch": 1, "heads_q": 4, "heads_kv": 2, "n_q": 64, "n_kv": 64,
                 "head_dim": 64, "sm_scale": 0.5, "window_left": -1, "window_right": -1}
    # The mask as every entry point applies it: causal folded in as window_right = 0, and a
    # bound that masks no key (left >= n_kv - 1) taken as unbounded.
    p = sagekit._C.check_args(q, k, v, np.empty(q.shape, np.float32), device="cpu",
                              causal=True, window_left=63)
    assert (p["window_left"], p["window_right"]) == (-1, 0)
    check("window_left", sagekit._C.check_args, q, k, v, np.empty(q.shape, np.float32),
          device="cpu", window_left=-2)


def test_errors_through_memoryview_without_numpy_types():
    # The buffer protocol reaches the same checks (and needs no NumPy at all).
    buf = memoryview(bytearray(4 * 64 * 2)).cast("f", (1, 1, 2, 64))
    out = memoryview(bytearray(4 * 64 * 2)).cast("f", (1, 1, 2, 64))
    sagekit._C.exact(buf, buf, buf, out)
    small = memoryview(bytearray(4 * 32 * 2)).cast("f", (1, 1, 2, 32))
    check("k", sagekit._C.exact, buf, small, buf, out)


def test_package_imports_and_simulates_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, sagekit\n"
        "assert sagekit.ops is None\n"
        "q = np.random.default_rng(0).standard_normal((1, 2, 32, 64)).astype(np.float16)\n"
        "out = sagekit.simulate(q, q, q)\n"
        "assert out.shape == q.shape and out.dtype == np.float32\n"
        "try:\n"
        "    sagekit.sageattn(q, q, q)\n"
        "except ImportError as e:\n"
        "    assert 'torch' in str(e)\n"
        "else:\n"
        "    raise SystemExit('sageattn without torch did not raise')\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@needs_torch
def test_torch_front_end_errors_on_cpu_tensors():
    import torch

    q = torch.randn(1, 4, 64, 64, dtype=torch.float16)
    k = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    sdpa = sagekit.scaled_dot_product_attention
    check("attn_mask", sdpa, q, q, q, attn_mask=torch.zeros(64, 64, dtype=torch.bool))
    check("dropout_p", sdpa, q, q, q, dropout_p=0.1)
    check("query", sdpa, q.float(), q, q)
    check("query", sdpa, q, q, q[..., :32])  # Ev != E is taken (MLA); the CPU device is not
    check("enable_gqa", sdpa, q, k, k)
    check("is_causal", sdpa, q, k[:, :, :32], k[:, :, :32], is_causal=True, enable_gqa=True)
    check("query", sdpa, q, k, k, enable_gqa=True)               # not on a CUDA device
    check("q", sagekit.sageattn, q, q, q)                        # not on a CUDA device
    check("layout", sagekit.sageattn, q, q, q, layout="HDN")
    check("k", sagekit.sageattn, q, [1], q)


@needs_torch
def test_patch_sdpa_restores_and_falls_back_only_when_asked():
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    q = torch.randn(1, 2, 16, 64)
    with sagekit.patch_sdpa() as stats:
        assert F.scaled_dot_product_attention is not original
        with pytest.raises(sagekit.ArgumentError):  # CPU float32: refused by default
            F.scaled_dot_product_attention(q, q, q)
    assert F.scaled_dot_product_attention is original and stats.calls == 1
    with pytest.raises(RuntimeError):
        with sagekit.patch_sdpa():
            raise RuntimeError("inside")
    assert F.scaled_dot_product_attention is original
    with sagekit.patch_sdpa(fallback=True) as stats:
        y = F.scaled_dot_product_attention(q, q, q)
        y2 = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    torch.testing.assert_close(y, original(q, q, q))
    torch.testing.assert_close(y2, y)
    assert stats.calls == 0 and stats.fallbacks == {"device/dtype": 1, "attn_mask": 1}


@pytest.mark.skipif(HAS_TORCH, reason="checks the message shown when torch is missing")
def test_torch_entry_points_explain_that_torch_is_missing():
    with pytest.raises(ImportError, match="torch"):
        sagekit.scaled_dot_product_attention(None, None, None)
