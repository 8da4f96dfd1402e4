"""Packed variable-length batches: simulate_varlen / exact_varlen on the CPU (NumPy, and CPU
torch tensors where torch is installed), and sageattn_varlen's refusal of host arrays (its GPU
tests are test_varlen_gpu.py)."""

import pytest

import sagekit
from conftest import check_argument_error as check
from conftest import needs_torch

np = pytest.importorskip("numpy", reason="needs numpy")

HEADS_Q, HEADS_KV, D = 4, 2, 64


def make_sequence(n_q, n_k, seed):
    """One sequence's q [n_q, Hq, D], k, v [n_k, Hkv, D], with channel offsets of its own in
    K and V (so that a statistic taken across sequences would show)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_q, HEADS_Q, D))
    k = rng.standard_normal((n_k, HEADS_KV, D)) + rng.standard_normal(D) * 5
    v = rng.standard_normal((n_k, HEADS_KV, D)) + rng.standard_normal(D) * 3
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)


def pack(seqs):
    q = np.concatenate([s[0] for s in seqs]) if seqs else np.zeros((0, HEADS_Q, D), np.float16)
    k = np.concatenate([s[1] for s in seqs]) if seqs else np.zeros((0, HEADS_KV, D), np.float16)
    v = np.concatenate([s[2] for s in seqs]) if seqs else np.zeros((0, HEADS_KV, D), np.float16)
    cu_q = np.concatenate([[0], np.cumsum([len(s[0]) for s in seqs])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([len(s[1]) for s in seqs])]).astype(np.int32)
    max_q = int(np.max(np.diff(cu_q), initial=0))
    max_k = int(np.max(np.diff(cu_k), initial=0))
    return q, k, v, cu_q, cu_k, max_q, max_k


SEQS = [(33, 130, 1), (0, 5, 2), (1, 1, 3), (97, 20, 4), (3, 0, 5), (130, 129, 6)]


@pytest.mark.parametrize("recipe", ["sage2_8b", "sage1_b", "int_flash_q", None])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (37, 0)),
                                             (False, (5, 9))])
def test_varlen_equals_the_dense_call_on_each_sequence(recipe, causal, window):
    seqs = [make_sequence(*s) for s in SEQS]
    q, k, v, cu_q, cu_k, max_q, max_k = pack(seqs)
    if recipe is None:
        out, lse = sagekit.exact_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                        window_size=window, return_lse=True)
    else:
        out, lse = sagekit.simulate_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                           window_size=window, recipe=recipe, return_lse=True)
    assert out.shape == q.shape and out.dtype == np.float32
    assert lse.shape == (HEADS_Q, len(q)) and lse.dtype == np.float32
    for b, (sq, sk, sv) in enumerate(seqs):
        rows = slice(cu_q[b], cu_q[b + 1])
        if recipe is None:
            d_out, d_lse = sagekit.exact(sq[None], sk[None], sv[None], is_causal=causal,
                                         layout="NHD", window_size=window, return_lse=True)
        else:
            d_out, d_lse = sagekit.simulate(sq[None], sk[None], sv[None], recipe=recipe,
                                            is_causal=causal, layout="NHD", window_size=window,
                                            return_lse=True)
        np.testing.assert_array_equal(out[rows], d_out[0], err_msg=f"sequence {b}")
        np.testing.assert_array_equal(lse[:, rows], d_lse[0], err_msg=f"sequence {b}")


@pytest.mark.parametrize("recipe", ["sage2_8b", None])
def test_v_with_a_head_dim_of_its_own(recipe):
    # MLA's kind of shape packed: out takes v's head dim, and each sequence is its dense call.
    rng = np.random.default_rng(7)
    seqs = [make_sequence(*s) for s in SEQS]
    seqs = [(q, k, rng.standard_normal((len(k), HEADS_KV, 24)).astype(np.float16)) for q, k, _ in seqs]
    q, k, _, cu_q, cu_k, max_q, max_k = pack(seqs)
    v = np.concatenate([s[2] for s in seqs])
    fn = sagekit.exact_varlen if recipe is None else sagekit.simulate_varlen
    kwargs = {} if recipe is None else {"recipe": recipe}
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, **kwargs)
    assert out.shape == (len(q), HEADS_Q, 24)
    dense = sagekit.exact if recipe is None else sagekit.simulate
    for b, (sq, sk, sv) in enumerate(seqs):
        d_out = dense(sq[None], sk[None], sv[None], is_causal=True, layout="NHD", **kwargs)
        np.testing.assert_array_equal(out[cu_q[b]:cu_q[b + 1]], d_out[0], err_msg=f"sequence {b}")


@pytest.mark.parametrize("recipe", ["sage2_8b", "auto", "sage1_b", "int_flash_q", "sage2_4b"])
def test_a_sequence_does_not_depend_on_its_neighbours(recipe):
    target = make_sequence(150, 211, 10)
    packings = [([target], 0),
                ([make_sequence(77, 90, 11), target, make_sequence(200, 64, 12)], 1),
                ([make_sequence(0, 40, 13), make_sequence(129, 300, 14), target], 2)]
    results = []
    for seqs, where in packings:
        q, k, v, cu_q, cu_k, max_q, max_k = pack(seqs)
        out, lse = sagekit.simulate_varlen(q, k, v, cu_q, cu_k, max_q, max_k, recipe=recipe,
                                           return_lse=True)
        rows = slice(cu_q[where], cu_q[where + 1])
        results.append((out[rows], lse[:, rows]))
    assert np.all(np.isfinite(results[0][0])) and np.all(np.isfinite(results[0][1]))
    for out, lse in results[1:]:
        assert out.tobytes() == results[0][0].tobytes()
        assert lse.tobytes() == results[0][1].tobytes()


def test_queries_without_keys_and_empty_batches():
    seqs = [make_sequence(5, 9, 1), make_sequence(3, 0, 2), make_sequence(0, 4, 3)]
    q, k, v, cu_q, cu_k, max_q, max_k = pack(seqs)
    for fn in (sagekit.simulate_varlen, sagekit.exact_varlen):
        out, lse = fn(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)
        assert np.all(out[5:8] == 0) and np.all(np.isneginf(lse[:, 5:8]))
        assert np.all(np.isfinite(out[:5])) and np.all(np.isfinite(lse[:, :5]))
    q, k, v, cu_q, cu_k, max_q, max_k = pack([])
    assert sagekit.simulate_varlen(q, k, v, cu_q, cu_k, max_q, max_k).shape == (0, HEADS_Q, D)


def test_argument_errors_name_the_argument():
    q, k, v, cu_q, cu_k, max_q, max_k = pack([make_sequence(5, 7, 1), make_sequence(3, 2, 2)])
    sim = sagekit.simulate_varlen
    check("cu_seqlens_q", sim, q, k, v, cu_q + 1, cu_k, max_q, max_k)
    assert "dtype must be i32" in check("cu_seqlens_q", sim, q, k, v, cu_q.astype(np.float32),
                                        cu_k, max_q, max_k)
    check("cu_seqlens_q", sim, q, k, v, cu_q.astype(np.int64), cu_k, max_q, max_k)
    assert "must end at k's token count 9" in check("cu_seqlens_k", sim, q, k, v, cu_q,
                                                     np.array([0, 7, 8], np.int32), max_q, max_k)
    check("cu_seqlens_k", sim, q, k, v, cu_q, cu_k[:2], max_q, max_k)
    assert "longest sequence, 5" in check("max_seqlen_q", sim, q, k, v, cu_q, cu_k, 4, max_k)
    check("max_seqlen_k", sim, q, k, v, cu_q, cu_k, max_q, 7.0)
    check("dropout_p", sim, q, k, v, cu_q, cu_k, max_q, max_k, 0.1)
    check("causal", sim, q, k, v, cu_q, cu_k, max_q, max_k, causal=1)
    check("window_size", sim, q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window_size=(4, 4))
    check("softmax_scale", sim, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=-1.0)
    check("q", sim, q[None], k, v, cu_q, cu_k, max_q, max_k)
    check("k", sim, q[:, :3], k, v, cu_q, cu_k, max_q, max_k)  # 3 query heads over 2 KV heads
    check("cu_seqlens_q", sim, q, k, v, list(cu_q), cu_k, max_q, max_k)
    check("recipe.inputs", sim, q, k, v, cu_q, cu_k, max_q, max_k, recipe="int_flash")


def test_sageattn_varlen_refuses_host_arrays_by_name():
    # The GPU front end takes CUDA tensors; host arrays are the simulator's.
    q, k, v, cu_q, cu_k, max_q, max_k = pack([make_sequence(5, 7, 1)])
    message = check("q", sagekit.sageattn_varlen, q, k, v, cu_q, cu_k, max_q, max_k)
    assert "CUDA tensors" in message and "simulate_varlen" in message
    check("dropout_p", sagekit.sageattn_varlen, q, k, v, cu_q, cu_k, max_q, max_k, 0.1)


@needs_torch
def test_cpu_torch_tensors_in_torch_tensors_out():
    import torch

    seqs = [make_sequence(20, 30, 1), make_sequence(7, 7, 2)]
    q, k, v, cu_q, cu_k, max_q, max_k = pack(seqs)
    want, want_lse = sagekit.simulate_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                             return_lse=True)
    t = [torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k)]
    out, lse = sagekit.simulate_varlen(*t, max_q, max_k, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert out.numpy().tobytes() == want.tobytes() and lse.numpy().tobytes() == want_lse.tobytes()
