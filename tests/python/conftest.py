"""Shared helpers for the Python tests.

CPU tests run everywhere (NumPy where they need arrays). GPU tests are marked with
`needs_gpu` and skip visibly, with the reason, where there is no compute-capability-9.0
GPU and torch; they never pass without running.
"""

import importlib.util

import pytest

import sagekit

GPU_REASON = "needs a CUDA GPU of compute capability 9.0 and torch"

HAS_NUMPY = importlib.util.find_spec("numpy") is not None
HAS_TORCH = sagekit.ops is not None


def _gpu_ready():
    if not HAS_TORCH:
        return False, GPU_REASON
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        return False, GPU_REASON
    if not sagekit.cuda_built:
        return False, "sagekit was built without CUDA (SAGE_CUDA=OFF), so its GPU kernels are absent"
    return True, ""


_READY, _WHY = _gpu_ready()

needs_gpu = pytest.mark.skipif(not _READY, reason=_WHY or GPU_REASON)
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
needs_numpy = pytest.mark.skipif(not HAS_NUMPY, reason="needs numpy")


def gpu_test_head_dims():
    """The head dims the GPU tests run: each kernel tile of the build and, on each, a smaller
    head dim the kernel zero-pads (40 on 64, 80 on 96, 112 on 128, 160 on 192, 224 on 256), where the build
    takes it (issue 34; every accepted dim would make the suites ~7x longer)."""
    accepted = set(sagekit.gpu_head_dims())
    padded = {64: 40, 96: 80, 128: 112, 192: 160, 256: 224}
    dims = []
    for d in sagekit.gpu_kernel_head_dims():
        dims.append(d)
        if padded.get(d) in accepted:
            dims.append(padded[d])
    return dims


def cosine(a, b):
    """Cosine similarity of two arrays/tensors, in float64, as a Python float."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def rel_l1(a, b):
    """sum|a - b| / sum|b|, the papers' relative L1 error."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).sum() / (np.abs(b).sum() + 1e-300))


def attention_f64(q, k, v, causal=False, scale=None, layout="HND", window=(-1, -1)):
    """An independent float64 attention in NumPy (bottom-right causal and sliding window,
    -1 an unbounded side; GQA by head groups).

    Returns (out, lse) with out in the input layout and lse [B, Hq, Nq].
    """
    import numpy as np

    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if layout == "NHD":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    d = q.shape[-1]
    s = np.einsum("bhid,bhjd->bhij", q, k) * (scale if scale is not None else 1.0 / np.sqrt(d))
    nq, nkv = q.shape[2], k.shape[2]
    i = np.arange(nq)[:, None]
    j = np.arange(nkv)[None, :]
    left, right = window[0], 0 if causal else window[1]
    if right >= 0:
        s = np.where(j <= i + (nkv - nq) + right, s, -np.inf)
    if left >= 0:
        s = np.where(j >= i + (nkv - nq) - left, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    out = np.where(den > 0, (p @ v) / np.where(den > 0, den, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(den[..., 0] > 0, m[..., 0] + np.log(den[..., 0]), -np.inf)
    if layout == "NHD":
        out = out.transpose(0, 2, 1, 3)
    return out, lse


def random_qkv(shape_q, shape_kv, dtype="float16", seed=0):
    """Random NumPy inputs with a per-channel offset in K (what smoothing is for)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = (rng.standard_normal(shape_kv) + rng.standard_normal(shape_kv[-1]) * 2).astype(dtype)
    v = rng.standard_normal(shape_kv).astype(dtype)
    return q, k, v


def check_argument_error(argument, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises the library's ArgumentError (a ValueError) naming `argument`,
    in the 'argument: ...' form; returns its message."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert isinstance(err, sagekit.ArgumentError), repr(err)
    assert err.argument == argument, f"expected {argument!r}, got {err.argument!r}: {err}"
    assert str(err).startswith(argument + ": "), str(err)
    return str(err)
