"""sageattn_varlen on the GPU: against simulate_varlen / exact_varlen, the packed LSE, GQA,
windows, lengths 0 and 1, strided views, the no-leak bit test, torch.compile(fullgraph=True),
CUDA-graph replay with new offsets, no host synchronization, the op's fake (opcheck), and the
argument errors. Every test needs a GPU of compute capability 9.0, torch and a CUDA build;
elsewhere each one is skipped with that reason (`pytest -rs`).
"""

import pytest

import sagekit
from conftest import HAS_TORCH, check_argument_error, cosine, needs_gpu

pytestmark = needs_gpu

if HAS_TORCH:
    import torch

HQ, HKV = 4, 2


def _sequence(n_q, n_k, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(d, generator=g) * 3
    q = torch.randn(n_q, HQ, d, generator=g)
    k = torch.randn(n_k, HKV, d, generator=g) + kb
    v = torch.randn(n_k, HKV, d, generator=g) + torch.randn(d, generator=g) * 2
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _pack(seqs, device="cuda"):
    q = torch.cat([s[0] for s in seqs]).to(device)
    k = torch.cat([s[1] for s in seqs]).to(device)
    v = torch.cat([s[2] for s in seqs]).to(device)
    lens_q = [len(s[0]) for s in seqs]
    lens_k = [len(s[1]) for s in seqs]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


LENGTHS = [(33, 130), (0, 5), (1, 1), (97, 20), (3, 0), (130, 129), (255, 257)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (37, 0)),
                                            (False, (20, 5))])
def test_matches_simulate_varlen_and_exact(d, dtype, causal, window):
    dt = getattr(torch, dtype)
    seqs = [_sequence(nq, nk, d, i, dt) for i, (nq, nk) in enumerate(LENGTHS)]
    q, k, v, cu_q, cu_k, max_q, max_k = _pack(seqs)
    out, lse = sagekit.sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                       window_size=window, recipe="sage2_8b", return_lse=True)
    assert out.shape == q.shape and out.dtype == dt and lse.shape == (HQ, q.shape[0])
    args = (q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), max_q, max_k)
    sim, sim_lse = sagekit.simulate_varlen(*args, causal=causal, window_size=window,
                                           recipe="sage2_8b", return_lse=True)
    ref = sagekit.exact_varlen(*args, causal=causal, window_size=window)
    got = out.float().cpu().numpy()
    assert cosine(got, sim.numpy()) > 0.99999
    assert cosine(got, ref.numpy()) > 0.99
    # A sequence with queries and no keys: zeros and -inf.
    first, last = int(cu_q[4]), int(cu_q[5])
    assert (out[first:last] == 0).all() and torch.isinf(lse[:, first:last]).all()
    finite = torch.isfinite(sim_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (lse.cpu()[finite] - sim_lse[finite]).abs().max() < 0.12


def test_gqa_mqa_and_strided_views():
    d = 128
    seqs = [_sequence(nq, nk, d, i, torch.float16) for i, (nq, nk) in enumerate(LENGTHS)]
    q, k, v, cu_q, cu_k, max_q, max_k = _pack(seqs)
    # A fused QKV buffer's views: token stride 2 * HQ * d, not contiguous.
    fused = torch.zeros(q.shape[0], 2, HQ, d, dtype=q.dtype, device="cuda")
    fused[:, 0] = q
    qs = fused[:, 0]
    assert not qs.is_contiguous()
    for hkv in (HKV, 1):
        kk, vv = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
        out = sagekit.sageattn_varlen(qs, kk, vv, cu_q, cu_k, max_q, max_k, causal=True,
                                      recipe="sage2_8b")
        want = sagekit.simulate_varlen(q.cpu(), kk.cpu(), vv.cpu(), cu_q.cpu(), cu_k.cpu(), max_q,
                                       max_k, causal=True, recipe="sage2_8b")
        assert cosine(out.float().cpu().numpy(), want.numpy()) > 0.99999


@pytest.mark.parametrize("recipe", ["sage2_8b", "auto", "sage2_4b"])
def test_neighbours_change_no_bit(recipe):
    target = _sequence(150, 211, 128, 1, torch.float16)
    contexts = [[target],
                [_sequence(77, 90, 128, 2, torch.float16), target, _sequence(200, 64, 128, 3, torch.float16)],
                [_sequence(0, 40, 128, 4, torch.float16), _sequence(129, 3000, 128, 5, torch.float16),
                 _sequence(1, 1, 128, 6, torch.float16), target]]
    at = [0, 1, 3]
    results = []
    for seqs, i in zip(contexts, at):
        q, k, v, cu_q, cu_k, max_q, max_k = _pack(seqs)
        out, lse = sagekit.sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                           recipe=recipe, return_lse=True)
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        results.append((out[a:b].cpu(), lse[:, a:b].cpu()))
    for out, lse in results[1:]:
        assert torch.equal(out.view(torch.int16), results[0][0].view(torch.int16))
        assert torch.equal(lse.view(torch.int32), results[0][1].view(torch.int32))


def test_no_host_sync_and_cuda_graph_replay_with_new_offsets():
    seqs = [_sequence(100, 120, 128, 1, torch.float16), _sequence(60, 80, 128, 2, torch.float16)]
    q, k, v, cu_q, cu_k, _, _ = _pack(seqs)
    max_q = max_k = 192
    torch.cuda.set_sync_debug_mode("error")  # any host read of a device value raises
    try:
        out = sagekit.sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sagekit.sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        captured = sagekit.sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    graph.replay()
    assert torch.equal(captured, out)
    # New offsets over the same tokens, written into the captured tensors.
    cu_q.copy_(torch.tensor([0, 30, 160], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, 150, 200], dtype=torch.int32))
    graph.replay()
    direct = sagekit.sageattn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert torch.equal(captured, direct)


def test_torch_compile_fullgraph():
    seqs = [_sequence(50, 70, 64, 1, torch.bfloat16), _sequence(9, 3, 64, 2, torch.bfloat16)]
    q, k, v, cu_q, cu_k, max_q, max_k = _pack(seqs)

    def f(q, k, v, cu_q, cu_k):
        return sagekit.sageattn_varlen(q * 1.0, k, v, cu_q, cu_k, max_q, max_k, causal=True) + 0

    compiled = torch.compile(f, fullgraph=True)  # raises on any graph break
    assert torch.equal(compiled(q, k, v, cu_q, cu_k), f(q, k, v, cu_q, cu_k))


def test_opcheck():
    seqs = [_sequence(50, 70, 64, 1, torch.float16), _sequence(0, 3, 64, 2, torch.float16)]
    q, k, v, cu_q, cu_k, max_q, max_k = _pack(seqs)
    torch.library.opcheck(torch.ops.sagekit.attention_varlen.default,
                          (q, k, v, cu_q, cu_k, max_q, max_k, True, -1, -1, None, "sage2_8b", True),
                          test_utils=("test_schema", "test_faketensor"))


def test_argument_errors():
    q, k, v, cu_q, cu_k, max_q, max_k = _pack([_sequence(5, 7, 64, 1, torch.float16)])
    fn = sagekit.sageattn_varlen
    check_argument_error("cu_seqlens_q", fn, q, k, v, cu_q.long(), cu_k, max_q, max_k)
    check_argument_error("cu_seqlens_k", fn, q, k, v, cu_q, cu_k.cpu(), max_q, max_k)
    check_argument_error("q", fn, q.cpu(), k, v, cu_q, cu_k, max_q, max_k)
    check_argument_error("k", fn, q, k.float(), v, cu_q, cu_k, max_q, max_k)
    check_argument_error("max_seqlen_k", fn, q, k, v, cu_q, cu_k, max_q, -1)
    check_argument_error("window_size", fn, q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                         window_size=(4, 4))
    check_argument_error("recipe.inputs", fn, q, k, v, cu_q, cu_k, max_q, max_k, recipe="int_flash")
