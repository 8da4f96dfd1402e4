"""The torch GPU path: sageattn, the SDPA drop-in, custom ops, torch.compile, CUDA graphs.

Every test here needs a GPU of compute capability 9.0, torch and a CUDA build of sagekit;
elsewhere each one is skipped with that reason (shown by `pytest -rs`).
"""

import pytest

import sagekit
from conftest import GPU_REASON, HAS_TORCH, cosine, gpu_test_head_dims, needs_gpu, rel_l1

pytestmark = needs_gpu

if HAS_TORCH:
    import torch
    import torch.nn.functional as F


def _qkv(b=2, hq=8, hkv=8, nq=512, nkv=512, d=128, dtype=None, seed=0, layout="HND"):
    dtype = dtype or torch.float16
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(h, n, offset=0.0):
        shape = (b, h, n, d) if layout == "HND" else (b, n, h, d)
        return (torch.randn(shape, generator=g, device="cuda") + offset).to(dtype)

    return make(hq, nq), make(hkv, nkv, offset=1.0), make(hkv, nkv)


def _close(a, b, atol=2e-3, rtol=2e-3):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def _np(t):
    return t.detach().float().cpu().numpy()


def test_gpu_build_is_complete():
    assert sagekit.gpu_available(), GPU_REASON
    assert 64 in sagekit.gpu_kernel_head_dims() and 128 in sagekit.gpu_kernel_head_dims()
    # Every multiple of 8 from 32 to the largest tile runs (issue 34).
    top = max(sagekit.gpu_kernel_head_dims())
    assert sagekit.gpu_head_dims() == list(range(32, top + 1, 8))
    assert hasattr(torch.ops.sagekit, "attention")


@pytest.mark.parametrize("d", gpu_test_head_dims())  # the tiles and a padded dim on each
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sageattn_matches_simulate_and_exact(d, causal, dtype):
    dt = getattr(torch, dtype)
    q, k, v = _qkv(b=1, hq=4, hkv=2, nq=300, nkv=300, d=d, dtype=dt)
    out, lse = sagekit.sageattn(q, k, v, is_causal=causal, return_lse=True)
    assert out.dtype == dt and out.shape == q.shape and out.device == q.device
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 300)
    sim, sim_lse = sagekit.simulate(q.cpu(), k.cpu(), v.cpu(), recipe="auto",
                                    is_causal=causal, return_lse=True)
    ref = sagekit.exact(q.cpu(), k.cpu(), v.cpu(), is_causal=causal)
    # The kernel follows the simulator closely; the recipe's own error is against exact.
    assert cosine(_np(out), sim.numpy()) > 0.9999
    assert rel_l1(_np(out), sim.numpy()) < 0.01
    _close(lse.cpu(), sim_lse, atol=1e-2, rtol=1e-3)
    assert cosine(_np(out), ref.numpy()) > 0.99


@pytest.mark.parametrize("recipe", ["sage2_8b", {"base": "sage2_8b"}, "sage2_8b,pv_accum=two_level"])
def test_recipe_forms_agree(recipe):
    q, k, v = _qkv(b=1, hq=2, hkv=2, nq=256, nkv=256)
    torch.testing.assert_close(sagekit.sageattn(q, k, v, recipe=recipe),
                               sagekit.sageattn(q, k, v, recipe="sage2_8b"), atol=0, rtol=0)


def test_recipe_errors_on_gpu_name_the_option():
    q, k, v = _qkv(b=1, hq=2, hkv=2, nq=128, nkv=128)
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.sageattn(q, k, v, recipe={"pv_accum": "fp99"})
    assert info.value.argument == "recipe.pv_accum"
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.sageattn(*(t[..., :44].contiguous() for t in (q, k, v)))
    assert info.value.argument == "q"  # head_dims are multiples of 8: 44 has no kernel
    assert "multiple of 8" in str(info.value)


def test_strided_views_match_contiguous_copies():
    torch.manual_seed(0)
    b, n, h, d = 2, 384, 4, 128
    # q, k and v packed in one [B, N, 3, H, D] buffer (as a fused QKV projection makes them):
    # each is a view with non-contiguous batch and token strides and a storage offset.
    packed = torch.randn(b, n + 64, 3, h, d, device="cuda", dtype=torch.float16)
    packed[:, :, 1] += 1.0
    q, k, v = packed[:, 64:, 0], packed[:, :, 1], packed[:, :, 2]
    assert q.storage_offset() > 0 and not q.is_contiguous()
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    for causal in (False, True):
        nhd = sagekit.sageattn(q, k, v, is_causal=causal, layout="NHD")
        _close(nhd, sagekit.sageattn(qc, kc, vc, is_causal=causal, layout="NHD"))
        # The same data as HND through transposed views (head stride < token stride).
        hnd = sagekit.sageattn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               is_causal=causal, layout="HND")
        _close(hnd.transpose(1, 2), nhd)
        _close(hnd, sagekit.sageattn(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                                     v.transpose(1, 2).contiguous(), is_causal=causal))
    # Non-contiguous batch and head strides in HND: every other head of a larger tensor.
    big_q, big_k, big_v = _qkv(b=3, hq=8, hkv=8, nq=256, nkv=256, seed=3)
    sq, sk, sv = big_q[::2, ::2], big_k[::2, ::2], big_v[::2, ::2]
    _close(sagekit.sageattn(sq, sk, sv), sagekit.sageattn(sq.contiguous(), sk.contiguous(),
                                                          sv.contiguous()))


def test_non_contiguous_head_dim_is_refused_by_name():
    q, k, v = _qkv(b=1, hq=2, hkv=2, nq=128, nkv=128, d=64)
    wide = torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.sageattn(q, wide[..., ::2], v)
    assert info.value.argument == "k"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", gpu_test_head_dims())  # the tiles and a padded dim on each
def test_sdpa_drop_in_matches_torch(dtype, causal, d):
    dt = getattr(torch, dtype)
    q, k, v = _qkv(b=2, hq=8, hkv=8, nq=1024, nkv=1024, d=d, dtype=dt, seed=1)
    ours = sagekit.scaled_dot_product_attention(q, k, v, is_causal=causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert cosine(_np(ours), _np(theirs)) > 0.99
    assert rel_l1(_np(ours), _np(theirs)) < 0.1


def test_sdpa_drop_in_gqa_scale_and_ranks():
    q, k, v = _qkv(b=2, hq=8, hkv=2, nq=512, nkv=512, d=128, seed=2)
    ours = sagekit.scaled_dot_product_attention(q, k, v, scale=0.05, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, scale=0.05, enable_gqa=True)
    assert cosine(_np(ours), _np(theirs)) > 0.99
    # 3-D [N, L, E] and 5-D [B1, B2, H, L, E] inputs, as torch accepts them.
    q3, k3, v3 = (x[0] for x in _qkv(b=1, hq=4, hkv=4, nq=256, nkv=256, d=64, seed=4))
    assert cosine(_np(sagekit.scaled_dot_product_attention(q3, k3, v3)),
                  _np(F.scaled_dot_product_attention(q3, k3, v3))) > 0.99
    q5, k5, v5 = (x.reshape(2, 1, 4, 256, 64) for x in _qkv(b=2, hq=4, hkv=4, nq=256, nkv=256, d=64))
    ours5 = sagekit.scaled_dot_product_attention(q5, k5, v5)
    assert ours5.shape == q5.shape
    assert cosine(_np(ours5), _np(F.scaled_dot_product_attention(q5, k5, v5))) > 0.99
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.scaled_dot_product_attention(q, k, v)
    assert info.value.argument == "enable_gqa"


def test_runs_on_the_current_stream():
    q, k, v = _qkv(b=1, hq=4, hkv=4, nq=512, nkv=512, seed=5)
    q_new = torch.randn_like(q)
    expected = sagekit.sageattn(q_new, k, v)
    stale = sagekit.sageattn(q, k, v)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # The side stream is held up before it writes q; an op that launched on any other
        # stream would read the old q and return `stale`.
        torch.cuda._sleep(200_000_000)
        q.copy_(q_new)
        out = sagekit.sageattn(q, k, v)
    torch.cuda.synchronize()
    assert not torch.equal(stale, expected)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_cuda_graph_capture_and_replay_give_fresh_outputs():
    q, k, v = _qkv(b=2, hq=4, hkv=2, nq=512, nkv=512, seed=6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        for _ in range(2):
            sagekit.sageattn(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sagekit.sageattn(q, k, v, is_causal=True, return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    torch.testing.assert_close(first, sagekit.sageattn(q, k, v, is_causal=True), atol=0, rtol=0)
    for seed in (7, 8):
        nq, nk, nv = _qkv(b=2, hq=4, hkv=2, nq=512, nkv=512, seed=seed)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        fresh, fresh_lse = sagekit.sageattn(nq, nk, nv, is_causal=True, return_lse=True)
        torch.testing.assert_close(out, fresh, atol=0, rtol=0)
        torch.testing.assert_close(lse, fresh_lse, atol=0, rtol=0)
        assert not torch.equal(out, first)


def test_torch_compile_fullgraph_has_no_graph_break():
    torch._dynamo.reset()
    q, k, v = _qkv(b=1, hq=8, hkv=2, nq=256, nkv=256, seed=9)

    def block(q, k, v):
        y = sagekit.sageattn(q * 1.0, k, v, is_causal=True, recipe={"base": "sage2_8b"})
        z = sagekit.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return y.float().sum(-1) + z.float().sum(-1)

    compiled = torch.compile(block, fullgraph=True)  # raises on any graph break
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), atol=1e-2, rtol=1e-3)
    explanation = torch._dynamo.explain(block)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_torch_compile_patched_sdpa_module():
    torch._dynamo.reset()

    class Attention(torch.nn.Module):
        def __init__(self, dim=512, heads=8):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            b, n, c = x.shape
            qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
            return self.proj(y.transpose(1, 2).reshape(b, n, c))

    model = Attention().cuda().half().eval()
    x = torch.randn(2, 512, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        reference = model(x)
        with sagekit.patch_sdpa() as stats:
            eager = model(x)
            compiled = torch.compile(model, fullgraph=True)(x)
    assert stats.calls >= 2
    assert cosine(_np(eager), _np(reference)) > 0.99
    torch.testing.assert_close(compiled, eager, atol=1e-2, rtol=1e-2)


def test_torch_compile_reduce_overhead_replays_fresh_outputs():
    # mode="reduce-overhead" runs the compiled graph as a CUDA graph.
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: sagekit.sageattn(q, k, v) + 0, mode="reduce-overhead",
                       fullgraph=True)
    for seed in range(4):
        q, k, v = _qkv(b=1, hq=4, hkv=4, nq=256, nkv=256, seed=20 + seed)
        got = fn(q, k, v).clone()
        torch.testing.assert_close(got, sagekit.sageattn(q, k, v), atol=0, rtol=0)


def test_fake_implementation_gives_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv(b=2, hq=8, hkv=2, nq=200, nkv=300, d=64, layout="NHD")
    real_out, real_lse = torch.ops.sagekit.attention(q, k, v, "NHD", False, -1, -1, None, "auto", True,
                                                     None, None, None, None)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out, lse = torch.ops.sagekit.attention(fq, fk, fv, "NHD", False, -1, -1, None, "auto",
                                               True,
                                               None, None, None, None)
    assert out.shape == real_out.shape == q.shape and out.dtype == real_out.dtype
    assert out.stride() == real_out.stride()
    assert lse.shape == real_lse.shape == (2, 8, 200) and lse.dtype == torch.float32
    torch.library.opcheck(torch.ops.sagekit.attention.default,
                          (q, k, v, "NHD", False, -1, -1, None, "auto", True, None, None, None,
                           None),
                          test_utils=("test_schema", "test_faketensor"))


def test_no_host_synchronization_in_the_call_path():
    q, k, v = _qkv(b=1, hq=4, hkv=4, nq=256, nkv=256, seed=10)
    sagekit.sageattn(q, k, v)  # first call: capability lookup and allocator warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for _ in range(3):
            sagekit.sageattn(q, k, v, is_causal=True)
            sagekit.scaled_dot_product_attention(q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_recipes_without_a_backward_refuse_the_backward_pass_by_name():
    # Only sagebwd trains (tests/python/test_training.py); any other recipe's forward runs on
    # tensors that require grad, and a backward pass that reaches it raises naming `recipe`.
    q, k, v = _qkv(b=1, hq=2, hkv=2, nq=128, nkv=128, seed=12)
    q.requires_grad_(True)
    out = sagekit.sageattn(q, k, v)  # the forward runs
    torch.testing.assert_close(out, sagekit.sageattn(q.detach(), k, v), atol=0, rtol=0)
    with pytest.raises(sagekit.ArgumentError) as info:
        out.float().sum().backward()
    assert info.value.argument == "recipe" and "use recipe='sagebwd'" in str(info.value)


def test_eager_fast_path_only_where_plain_eager_dispatch_would_run_the_body():
    from torch.utils._python_dispatch import TorchDispatchMode

    from sagekit import ops

    q, k, v = _qkv(b=1, hq=2, hkv=2, nq=160, nkv=200, seed=13)
    args = (q, k, v, "HND", True, -1, -1, None, "sage2_8b", True, None, None, None, None)
    assert ops.plain_eager(args)
    # The direct body and the dispatched op compute the same thing, bit for bit.
    fast, slow = ops.call_attention(*args), torch.ops.sagekit.attention(*args)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    q.requires_grad_(True)
    assert not ops.plain_eager(args)  # the op must see it: only it records the autograd node
    with torch.no_grad():
        assert ops.plain_eager(args)
    q.requires_grad_(False)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            return func(*a, **(kw or {}))

    with Watch():
        assert not ops.plain_eager(args)
    assert not ops.plain_eager((torch.nn.Parameter(q, requires_grad=False),) + args[1:])
    # The two steps through the fast path against the one-step op (the workspace's padding
    # is not defined, so the outputs are compared, not the workspaces).
    kv = sagekit.quantize_kv(k, v, recipe="sage2_8b")
    two_steps = sagekit.sageattn_quantized_kv(q, kv, is_causal=True, return_lse=True)
    for a, b in zip(two_steps, slow):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_auto_recipe_on_this_gpu_is_balanced_sage2():
    q, k, v = _qkv(b=1, hq=2, hkv=2, nq=128, nkv=128, seed=11)
    torch.testing.assert_close(sagekit.sageattn(q, k, v),
                               sagekit.sageattn(q, k, v, recipe="sage2_8b_balanced"), atol=0, rtol=0)
    from sagekit.ops import resolve_auto

    assert resolve_auto("auto", q.device) == "sage2_8b_balanced"
    # K/V quantized ahead of Q cannot be balanced against it: the two-step path's auto.
    assert resolve_auto("auto", q.device, two_step=True) == "sage2_8b"


@pytest.mark.parametrize("d", gpu_test_head_dims())
@pytest.mark.parametrize("causal, window, nq, nkv", [
    (True, (256, -1), 700, 700),     # causal with a left window (the long-context shape)
    (False, (100, 40), 300, 500),    # both bounds, windows smaller than a K/V tile
    (False, (-1, 10), 500, 300),     # the first rows see no key: 0 and LSE -inf
    (True, (0, 0), 200, 200)])       # one key per row
def test_sliding_window_matches_simulate(d, causal, window, nq, nkv):
    q, k, v = _qkv(b=1, hq=4, hkv=2, nq=nq, nkv=nkv, d=d, seed=21)
    # sage2_8b rather than "auto": the two steps below compare bits, and auto's one-call recipe
    # is the balanced one, which the two steps cannot take.
    out, lse = sagekit.sageattn(q, k, v, is_causal=causal, window_size=window, return_lse=True,
                                recipe="sage2_8b")
    sim, sim_lse = sagekit.simulate(q.cpu(), k.cpu(), v.cpu(), is_causal=causal,
                                    window_size=window, return_lse=True, recipe="sage2_8b")
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    masked = torch.isneginf(sim_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), masked)
    assert torch.all(out.cpu()[masked] == 0)
    assert cosine(_np(out), sim.numpy()) > 0.9999
    assert rel_l1(_np(out), sim.numpy()) < 0.01
    _close(lse.cpu()[~masked], sim_lse[~masked], atol=1e-2, rtol=1e-3)
    # The two steps take the same window, with the same bits.
    kv = sagekit.quantize_kv(k, v)
    two = sagekit.sageattn_quantized_kv(q, kv, is_causal=causal, window_size=window)
    torch.testing.assert_close(two, out, atol=0, rtol=0)


def test_window_covering_every_key_is_no_window_and_causal_is_minus_one_zero():
    q, k, v = _qkv(b=1, hq=4, hkv=2, nq=384, nkv=512, seed=22)
    torch.testing.assert_close(sagekit.sageattn(q, k, v, window_size=(511, 383)),
                               sagekit.sageattn(q, k, v), atol=0, rtol=0)
    torch.testing.assert_close(sagekit.sageattn(q, k, v, window_size=(-1, 0)),
                               sagekit.sageattn(q, k, v, is_causal=True), atol=0, rtol=0)


def check_argument(argument, fn, *args, **kwargs):
    with pytest.raises(sagekit.ArgumentError) as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, str(info.value)


def test_window_errors_name_window_size():
    q, k, v = _qkv(b=1, hq=2, hkv=2, nq=128, nkv=128, seed=23)
    check_argument("window_size", sagekit.sageattn, q, k, v, window_size=(-3, 0))
    check_argument("window_size", sagekit.sageattn, q, k, v, window_size=(2,))
    check_argument("window_size", sagekit.sageattn, q, k, v, is_causal=True, window_size=(64, 8))
    kv = sagekit.quantize_kv(k, v)
    check_argument("window_size", sagekit.sageattn_quantized_kv, q, kv, window_size=(0.5, 0))
    # At the op level the library names its own arguments.
    check_argument("window_left", torch.ops.sagekit.attention, q, k, v, "HND", False, -4, -1,
                   None, "auto", False, None, None, None, None)


def test_sliding_window_in_cuda_graphs_and_torch_compile():
    torch._dynamo.reset()
    q, k, v = _qkv(b=1, hq=8, hkv=2, nq=1024, nkv=1024, seed=24)

    def block(q, k, v):
        return sagekit.sageattn(q * 1.0, k, v, is_causal=True, window_size=(300, 0)).float().sum(-1)

    compiled = torch.compile(block, fullgraph=True)  # raises on any graph break
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), atol=1e-2, rtol=1e-3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sagekit.sageattn(q, k, v, window_size=(300, 0))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sagekit.sageattn(q, k, v, window_size=(300, 0))
    nq, nk, nv = _qkv(b=1, hq=8, hkv=2, nq=1024, nkv=1024, seed=25)
    q.copy_(nq), k.copy_(nk), v.copy_(nv)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, sagekit.sageattn(nq, nk, nv, window_size=(300, 0)), atol=0, rtol=0)
