"""simulate_backward / exact_backward on NumPy arrays and CPU torch tensors (no GPU needed)."""

import pytest

import sagekit
from conftest import cosine, needs_torch, random_qkv, rel_l1

np = pytest.importorskip("numpy", reason="needs numpy")


def gradients_f64(q, k, v, do, causal=False, scale=None):
    """Attention's gradients written independently in NumPy float64 (HND, GQA by head groups)."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhid,bhjd->bhij", q, kr) * scale
    nq, nkv = q.shape[2], k.shape[2]
    if causal:
        s = np.where(np.arange(nkv)[None, :] <= np.arange(nq)[:, None] + (nkv - nq), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ vr
    dp = do @ vr.transpose(0, 1, 3, 2)
    ds = p * (dp - (do * out).sum(axis=-1, keepdims=True)) * scale
    dq = ds @ kr
    dk = (ds.transpose(0, 1, 3, 2) @ q).reshape(k.shape[0], k.shape[1], group, nkv, -1).sum(axis=2)
    dv = (p.transpose(0, 1, 3, 2) @ do).reshape(k.shape[0], k.shape[1], group, nkv, -1).sum(axis=2)
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
def test_exact_backward_matches_an_independent_float64_gradient(causal):
    q, k, v = random_qkv((2, 4, 50, 32), (2, 2, 70, 32))
    do = np.random.default_rng(1).standard_normal(q.shape).astype("float16")
    dq, dk, dv = sagekit.exact_backward(q, k, v, do, is_causal=causal, scale=0.2)
    for got, want in zip((dq, dk, dv), gradients_f64(q, k, v, do, causal=causal, scale=0.2)):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sagebwd_gradients_and_its_int8_dp_ablation():
    q, k, v = random_qkv((1, 2, 256, 64), (1, 2, 256, 64))
    do = np.random.default_rng(2).standard_normal(q.shape).astype("float16")
    ref = sagekit.exact_backward(q, k, v, do)
    got = sagekit.simulate_backward(q, k, v, do)  # recipe="sagebwd"
    for name, g, r, bar in zip(("dq", "dk", "dv"), got, ref, (0.995, 0.995, 0.999)):
        assert cosine(g, r) > bar, name
        assert rel_l1(g, r) < 0.1, name
    ablation = sagekit.simulate_backward(q, k, v, do, recipe="sagebwd,dp_format=int8")
    assert cosine(ablation[0], ref[0]) < cosine(got[0], ref[0])  # INT8 dO V^T costs dQ accuracy
    np.testing.assert_array_equal(ablation[2], got[2])  # dV does not depend on dP


def test_simulate_backward_returns_the_forward_of_simulate():
    q, k, v = random_qkv((1, 2, 70, 64), (1, 1, 90, 64))
    do = np.random.default_rng(3).standard_normal(q.shape).astype("float16")
    dq, dk, dv, out, lse = sagekit.simulate_backward(q, k, v, do, is_causal=True, return_forward=True)
    want_out, want_lse = sagekit.simulate(q, k, v, recipe="sagebwd", is_causal=True, return_lse=True)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape


def test_recipes_without_a_backward_are_refused_by_name():
    q, k, v = random_qkv((1, 1, 16, 64), (1, 1, 16, 64))
    do = np.zeros_like(q)
    with pytest.raises(sagekit.ArgumentError) as e:
        sagekit.simulate_backward(q, k, v, do, recipe="sage2_8b")
    assert e.value.argument == "recipe.dv_format" and "no backward" in str(e.value)
    with pytest.raises(sagekit.ArgumentError) as e:
        sagekit.simulate_backward(q, k, v, do[:, :, :8])
    assert e.value.argument == "dout"


def test_backward_options_round_trip_through_the_recipe_vocabulary():
    r = sagekit.recipe("sagebwd")
    assert (r["dv_format"], r["dp_format"], r["dq_format"], r["dk_format"]) == \
        ("int8", "fp16", "int8", "int8")
    assert (r["p_scale"], r["v_scale"]) == ("per_token", "per_block")
    assert (r["bwd_p_granularity"], r["bwd_ds_granularity"]) == ("per_token", "per_token")
    # The paper's dS, one scale per tile, is the preset sagebwd_block.
    assert sagekit.recipe("sagebwd", bwd_ds_granularity="per_block") == sagekit.recipe("sagebwd_block")
    assert sagekit.recipe("sagebwd_block")["bwd_ds_granularity"] == "per_block"
    assert sagekit.recipe("sagebwd", dp_format="int8")["name"] == "custom"
    assert sagekit.recipe("sage2_8b")["dv_format"] == "none"
    with pytest.raises(sagekit.ArgumentError) as e:
        sagekit.recipe("sagebwd", qk_granularity="per_thread")
    assert e.value.argument == "recipe.dq_format"


@needs_torch
def test_simulate_backward_on_torch_tensors():
    import torch

    q, k, v = (torch.from_numpy(x) for x in random_qkv((1, 2, 40, 64), (1, 2, 40, 64)))
    do = torch.randn(q.shape, dtype=torch.float16)
    dq, dk, dv = sagekit.simulate_backward(q, k, v, do)
    assert isinstance(dq, torch.Tensor) and dq.dtype == torch.float32 and dk.shape == k.shape
    ref = sagekit.exact_backward(q, k, v, do)
    assert cosine(dv, ref[2]) > 0.999
