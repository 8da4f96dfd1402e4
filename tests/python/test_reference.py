"""simulate / exact on NumPy arrays and CPU torch tensors (no GPU needed)."""

import pytest

import sagekit
from conftest import HAS_TORCH, attention_f64, cosine, needs_torch, random_qkv, rel_l1

np = pytest.importorskip("numpy", reason="needs numpy")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_exact_matches_an_independent_float64_attention(causal, layout):
    if layout == "HND":
        q, k, v = random_qkv((2, 4, 70, 64), (2, 2, 90, 64))
    else:
        q, k, v = random_qkv((2, 70, 4, 64), (2, 90, 2, 64))
    out, lse = sagekit.exact(q, k, v, is_causal=causal, layout=layout, return_lse=True)
    ref_out, ref_lse = attention_f64(q, k, v, causal=causal, layout=layout)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == q.shape
    assert lse.shape == (2, 4, 70) and lse.dtype == np.float32
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d, dv", [(96, 48), (40, 136)])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_v_with_a_head_dim_of_its_own(d, dv, layout):
    # MLA's kind of shape: the output takes V's head dim, the scale Q/K's.
    q, k, _ = random_qkv((1, 4, 50, d), (1, 2, 70, d), seed=3)
    _, _, v = random_qkv((1, 4, 50, dv), (1, 2, 70, dv), seed=4)
    if layout == "NHD":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    out, lse = sagekit.exact(q, k, v, is_causal=True, layout=layout, return_lse=True)
    ref_out, ref_lse = attention_f64(q, k, v, causal=True, layout=layout)
    assert out.shape == ref_out.shape and out.shape[-1] == dv
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    sim = sagekit.simulate(q, k, v, is_causal=True, layout=layout)
    assert sim.shape == out.shape
    assert cosine(sim, ref_out) > 0.999 and rel_l1(sim, ref_out) < 0.06


def test_exact_scale_and_rows_without_keys():
    # n_q > n_kv with causal: the first rows see no key (bottom-right alignment) -> zeros.
    q, k, v = random_qkv((1, 2, 40, 64), (1, 2, 30, 64))
    out, lse = sagekit.exact(q, k, v, is_causal=True, scale=0.05, return_lse=True)
    ref_out, ref_lse = attention_f64(q, k, v, causal=True, scale=0.05)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    assert np.all(out[:, :, :10] == 0) and np.all(np.isneginf(lse[:, :, :10]))
    np.testing.assert_allclose(lse[:, :, 10:], ref_lse[:, :, 10:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal, window", [(False, (16, 4)), (False, (-1, 0)), (True, (20, -1)),
                                             (False, (5, -1)), (True, (0, 0))])
def test_exact_and_simulate_with_a_sliding_window(causal, window):
    # n_q 70 > n_kv 50 + right 4: the first rows see no key under a right bound.
    q, k, v = random_qkv((1, 4, 70, 64), (1, 2, 50, 64), seed=3)
    out, lse = sagekit.exact(q, k, v, is_causal=causal, window_size=window, return_lse=True)
    ref_out, ref_lse = attention_f64(q, k, v, causal=causal, window=window)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    sim, sim_lse = sagekit.simulate(q, k, v, is_causal=causal, window_size=window, return_lse=True)
    assert not np.isnan(sim).any() and not np.isnan(sim_lse).any()
    assert np.array_equal(np.isneginf(sim_lse), np.isneginf(ref_lse))
    assert np.all(sim[np.broadcast_to(~finite[..., None], sim.shape)] == 0)
    assert cosine(sim, ref_out) > 0.999


def test_simulate_window_equivalences():
    q, k, v = random_qkv((1, 2, 200, 64), (1, 2, 260, 64), seed=4)
    # A window covering every key is no window; causal is the window (-1, 0): bit for bit.
    np.testing.assert_array_equal(sagekit.simulate(q, k, v),
                                  sagekit.simulate(q, k, v, window_size=(259, 199)))
    np.testing.assert_array_equal(sagekit.simulate(q, k, v, is_causal=True),
                                  sagekit.simulate(q, k, v, window_size=(-1, 0)))


# INT4 Q/K on Gaussian data is the coarsest of these (the SageAttention2 paper reports its
# 4-bit variant a step below the 8-bit ones as well).
@pytest.mark.parametrize("recipe, min_cos, max_l1", [
    ("sage2_8b", 0.999, 0.05), ("sage1_b", 0.999, 0.05), ("sage2pp_8b", 0.995, 0.1),
    ("sage2_4b", 0.97, 0.25)])
def test_simulate_is_close_to_exact(recipe, min_cos, max_l1):
    q, k, v = random_qkv((1, 4, 256, 128), (1, 4, 256, 128), seed=1)
    sim = sagekit.simulate(q, k, v, recipe=recipe)
    ref = sagekit.exact(q, k, v)
    assert sim.dtype == np.float32 and sim.shape == q.shape
    assert cosine(sim, ref) > min_cos
    assert rel_l1(sim, ref) < max_l1
    # Quantization must change something, or the recipe was not applied.
    assert not np.array_equal(sim, ref)


def test_simulate_default_and_auto_are_sage2_8b_balanced():
    q, k, v = random_qkv((1, 2, 128, 64), (1, 2, 128, 64), seed=2)
    a = sagekit.simulate(q, k, v)
    b = sagekit.simulate(q, k, v, recipe="auto")
    c = sagekit.simulate(q, k, v, recipe={"base": "sage2_8b_balanced"})
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_simulate_recipe_dict_changes_the_result():
    q, k, v = random_qkv((1, 2, 256, 64), (1, 2, 256, 64), seed=3)
    a = sagekit.simulate(q, k, v, recipe="sage2_8b")
    b = sagekit.simulate(q, k, v, recipe={"base": "sage2_8b", "qk_granularity": "per_tensor"})
    assert not np.array_equal(a, b)


def test_simulate_is_deterministic():
    q, k, v = random_qkv((2, 2, 200, 64), (2, 2, 200, 64), seed=4)
    np.testing.assert_array_equal(sagekit.simulate(q, k, v, is_causal=True),
                                  sagekit.simulate(q, k, v, is_causal=True))


@pytest.mark.parametrize("fn", [sagekit.simulate, sagekit.exact])
def test_strided_views_equal_contiguous_copies(fn):
    rng = np.random.default_rng(5)
    # One buffer holding q, k and v side by side ([B, N, 3, H, D]), sliced with offsets:
    # non-contiguous batch/token/head strides and nonzero storage offsets.
    packed = rng.standard_normal((2, 150, 3, 4, 64)).astype(np.float16)
    q, k, v = packed[:, 10:140, 0], packed[:, :, 1], packed[:, :, 2]
    assert not q.flags.c_contiguous
    a = fn(q, k, v, layout="NHD", is_causal=True)
    b = fn(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
           layout="NHD", is_causal=True)
    np.testing.assert_array_equal(a, b)
    # The same data seen as HND through a transposed view.
    c = fn(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
           layout="HND", is_causal=True)
    np.testing.assert_array_equal(c.transpose(0, 2, 1, 3), a)


def test_read_only_inputs_are_accepted():
    q, k, v = random_qkv((1, 2, 64, 64), (1, 2, 64, 64), seed=6)
    for x in (q, k, v):
        x.setflags(write=False)
    assert sagekit.exact(q, k, v).shape == q.shape


def test_gqa_and_mqa():
    q, k, v = random_qkv((1, 8, 64, 64), (1, 1, 64, 64), seed=7)
    out = sagekit.exact(q, k, v)
    ref, _ = attention_f64(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    sim = sagekit.simulate(q, k, v)
    assert cosine(sim, ref) > 0.999


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_cpu_tensors_in_torch_out(dtype):
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    q = torch.randn(1, 4, 96, 64, dtype=dt)
    k = torch.randn(1, 2, 96, 64, dtype=dt)
    v = torch.randn(1, 2, 96, 64, dtype=dt, requires_grad=True)  # detached, not rejected
    out, lse = sagekit.simulate(q, k, v, is_causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.shape == (1, 4, 96)
    ref = sagekit.exact(q, k, v, is_causal=True)
    expected, _ = attention_f64(q.float().numpy(), k.float().numpy(), v.detach().float().numpy(),
                                causal=True)
    np.testing.assert_allclose(ref.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert cosine(out.numpy(), ref.numpy()) > 0.999
    if dtype == "float16":  # the same values through NumPy give the same bits
        np.testing.assert_array_equal(
            out.numpy(), sagekit.simulate(q.numpy(), k.numpy(), v.detach().numpy(), is_causal=True))


@needs_torch
def test_torch_cpu_strided_views():
    import torch

    torch.manual_seed(1)
    packed = torch.randn(2, 4, 3, 160, 64, dtype=torch.float16)  # [B, H, 3, N, D]
    q, k, v = packed[:, :, 0, 16:], packed[:, :, 1], packed[:, :, 2]
    a = sagekit.simulate(q, k, v)
    b = sagekit.simulate(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(a, b)


@needs_torch
def test_torch_gpu_tensors_are_refused_by_the_cpu_references():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to make a GPU tensor")
    q = torch.randn(1, 1, 16, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.simulate(q, q, q)
    assert info.value.argument == "q"


def test_kinds_must_match():
    q, k, v = random_qkv((1, 1, 16, 64), (1, 1, 16, 64))
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.exact(q, k.tolist(), v)
    assert info.value.argument == "k"
    if HAS_TORCH:
        import torch

        with pytest.raises(sagekit.ArgumentError) as info:
            sagekit.exact(torch.from_numpy(q), k, v)
        assert info.value.argument == "k"
