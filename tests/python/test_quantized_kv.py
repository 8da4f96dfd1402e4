"""Attention in two steps: quantize_kv once, then sageattn_quantized_kv any number of times.

The binding tests need NumPy only, and the tracing tests (fake implementations, one graph
under torch.compile) need torch but no GPU: they run on fake CUDA tensors. The rest needs a
GPU of compute capability 9.0 and skips visibly elsewhere.
"""

import pytest

import sagekit
from conftest import HAS_TORCH, gpu_test_head_dims, needs_gpu, needs_numpy, needs_torch, random_qkv

if HAS_TORCH:
    import torch


def check(argument, fn, *args, **kwargs):
    """fn raises an ArgumentError naming `argument`, in the library's 'argument: ...' form."""
    with pytest.raises(sagekit.ArgumentError) as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, f"expected {argument!r}: {info.value}"
    assert str(info.value).startswith(argument + ": "), str(info.value)
    return str(info.value)


# ---- the bindings (NumPy only; any build) ---------------------------------------------------

@needs_numpy
def test_binding_kv_workspace_bytes():
    C = sagekit._C
    check("batch", C.kv_workspace_bytes, -1, 2, 128, 64)
    check("n_kv", C.kv_workspace_bytes, 1, 2, -5, 64)
    check("recipe", C.kv_workspace_bytes, 1, 2, 128, 64, recipe="sage4")
    if not sagekit.cuda_built:
        # Every GPU entry point of a build without CUDA says why it cannot run.
        check("device", C.kv_workspace_bytes, 1, 2, 128, 64)
        return
    # Shape arithmetic only: this runs without a GPU. The workspace holds at least one byte
    # per element of K and of V.
    small = C.kv_workspace_bytes(1, 2, 300, 64)
    assert small >= 2 * 2 * 300 * 64
    assert C.kv_workspace_bytes(batch=2, heads_kv=2, n_kv=300, head_dim=64,
                                recipe="sage2_8b") >= 2 * small - 4096


@needs_numpy
def test_binding_two_step_argument_errors():
    import numpy as np

    C = sagekit._C
    q, k, v = random_qkv((1, 4, 64, 64), (1, 2, 64, 64))
    out = np.empty(q.shape, np.float16)
    check("k", C.quantize_kv, k[0], v)                     # 3 dimensions
    check("layout", C.quantize_kv, k, v, layout="HDN")
    check("recipe", C.quantize_kv, k, v, recipe="sage4")
    # Without CUDA there is nothing to size; with it, host arrays need a device workspace.
    check("workspace" if sagekit.cuda_built else "device", C.quantize_kv, k, v)
    check("workspace", C.attention_from_quantized_kv, q, k, v, out)  # the buffer is required
    check("recipe.pv_accum", C.gpu_supports, {"pv_accum": "fp64"})
    assert C.gpu_supports("sage2_8b") is sagekit.cuda_built
    assert sagekit.gpu_supports("sage3_fp4") is False   # no sm_90 kernel for FP4


# ---- tracing on fake CUDA tensors (torch; no GPU) ------------------------------------------

def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A ShapeEnv, as torch.compile and export have: in a build without CUDA the fake
    # quantize_kv gives the workspace an unbacked (symbolic) byte count, which needs one.
    return FakeTensorMode(shape_env=ShapeEnv())


@needs_torch
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_fake_implementations_give_shapes_without_a_gpu(layout, return_lse):
    b, hq, hkv, nq, nkv, d = 2, 8, 2, 100, 300, 64

    def shape(h, n):
        return (b, h, n, d) if layout == "HND" else (b, n, h, d)

    with _fake_mode():
        q = torch.empty(shape(hq, nq), device="cuda", dtype=torch.bfloat16)
        k = torch.empty(shape(hkv, nkv), device="cuda", dtype=torch.bfloat16)
        workspace = torch.ops.sagekit.quantize_kv(k, k, layout, "auto", None, None)
        out, lse = torch.ops.sagekit.attention_from_quantized_kv(
            q, k, k, workspace, layout, True, -1, -1, None, "auto", return_lse, None, None, None,
            None)
    assert workspace.dtype == torch.uint8 and workspace.dim() == 1
    assert workspace.device.type == "cuda"
    if sagekit.cuda_built:
        # kv_workspace_bytes needs no device, so the fake has the real op's exact size.
        assert workspace.shape[0] == sagekit._C.kv_workspace_bytes(b, hkv, nkv, d, "sage2_8b")
    else:
        assert isinstance(workspace.shape[0], torch.SymInt)  # unknown: no workspace layout
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert out.stride() == torch.empty(q.shape, device="meta").stride()  # contiguous
    assert lse.dtype == torch.float32
    assert lse.shape == ((b, hq, nq) if return_lse else (0,))


@needs_torch
@pytest.mark.parametrize("dynamic", [False, True])
def test_two_step_traces_as_one_graph_without_a_gpu(dynamic):
    # Dynamo over fake CUDA tensors: the whole function, both ops included, must be one
    # graph (fullgraph=True raises on any break). The backend runs the graph on the same
    # fake tensors, so nothing needs a device.
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(q, k, v):
        kv = sagekit.quantize_kv(k, v, layout="NHD", recipe={"base": "sage2_8b"})
        a = sagekit.sageattn_quantized_kv(q, kv, is_causal=True)
        b, lse = sagekit.sageattn_quantized_kv(q * 2, kv, return_lse=True)
        return a.float() + b.float(), lse

    with _fake_mode():
        q = torch.empty(1, 64, 8, 64, device="cuda", dtype=torch.float16)
        k = torch.empty(1, 96, 2, 64, device="cuda", dtype=torch.float16)
        out, lse = torch.compile(block, backend=backend, fullgraph=True, dynamic=dynamic)(q, k, k)
    assert out.shape == q.shape and lse.shape == (1, 8, 64)
    assert len(graphs) == 1
    # Dynamo records the op packet (sagekit.quantize_kv), later stages its overload (.default).
    targets = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes
               if n.op == "call_function"]
    assert targets.count("sagekit.quantize_kv") == 1, targets
    assert targets.count("sagekit.attention_from_quantized_kv") == 2, targets
    torch._dynamo.reset()


@needs_torch
def test_two_step_front_end_errors_without_a_gpu():
    cpu = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    check("k", sagekit.quantize_kv, cpu, cpu)                    # not on a CUDA device
    check("k", sagekit.quantize_kv, cpu[0], cpu)                 # 3 dimensions
    check("k", sagekit.quantize_kv, [1], cpu)
    check("layout", sagekit.quantize_kv, cpu, cpu, layout="BHSD")
    check("k", sagekit.quantize_kv, cpu.float(), cpu.float())    # float32
    check("v", sagekit.quantize_kv, cpu, cpu.bfloat16())
    check("kv", sagekit.sageattn_quantized_kv, cpu, (cpu, cpu))
    with _fake_mode():
        k = torch.empty(2, 2, 96, 64, device="cuda", dtype=torch.float16)
        kv = sagekit.quantize_kv(k, k)
        q = torch.empty(2, 8, 32, 64, device="cuda", dtype=torch.float16)
        check("q", sagekit.sageattn_quantized_kv, q.bfloat16(), kv)          # dtype
        check("q", sagekit.sageattn_quantized_kv, q[..., :32], kv)           # head_dim
        check("q", sagekit.sageattn_quantized_kv, q[:1], kv)                 # batch
        check("q", sagekit.sageattn_quantized_kv, q[:, :3], kv)              # heads
        check("q", sagekit.sageattn_quantized_kv, q.transpose(2, 3), kv)     # head_dim strided
        check("q", sagekit.sageattn_quantized_kv, torch.empty(2, 8, 32, 64, dtype=torch.float16), kv)
        check("is_causal", sagekit.sageattn_quantized_kv, q, kv, is_causal=1)
        out = sagekit.sageattn_quantized_kv(q, kv)
    assert out.shape == q.shape


# ---- on the GPU ----------------------------------------------------------------------------

def _qkv(b=2, hq=8, hkv=8, nq=512, nkv=512, d=128, dtype=None, seed=0, layout="HND"):
    dtype = dtype or torch.float16
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(h, n, offset=0.0):
        shape = (b, h, n, d) if layout == "HND" else (b, n, h, d)
        return (torch.randn(shape, generator=g, device="cuda") + offset).to(dtype)

    return make(hq, nq), make(hkv, nkv, offset=1.0), make(hkv, nkv)


def _same(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0)  # bit for bit (NaN/inf alike)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("d", gpu_test_head_dims())  # the tiles and a padded dim on each
def test_two_steps_equal_one_call_bit_for_bit(dtype, causal, heads, d):
    hq, hkv = heads
    q, k, v = _qkv(b=2, hq=hq, hkv=hkv, nq=200, nkv=333, d=d, dtype=getattr(torch, dtype))
    expected, expected_lse = sagekit.sageattn(q, k, v, is_causal=causal, recipe="sage2_8b",
                                              return_lse=True)
    kv = sagekit.quantize_kv(k, v, recipe="sage2_8b")
    out, lse = sagekit.sageattn_quantized_kv(q, kv, is_causal=causal, return_lse=True)
    _same(out, expected)
    _same(lse, expected_lse)
    _same(sagekit.sageattn_quantized_kv(q, kv, is_causal=causal), expected)  # without LSE


@needs_gpu
def test_two_steps_nhd_views_scale_and_auto_recipe():
    b, n, h, d = 2, 384, 4, 64
    packed = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
    packed[:, :, 1] += 1.0
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]  # strided views, offsets
    kv = sagekit.quantize_kv(k, v, layout="NHD")  # "auto": sage2_8b in the two steps
    for causal in (False, True):
        _same(sagekit.sageattn_quantized_kv(q, kv, is_causal=causal, scale=0.1),
              sagekit.sageattn(q, k, v, is_causal=causal, scale=0.1, layout="NHD", recipe="sage2_8b"))


@needs_gpu
def test_two_steps_with_prequantized_int8_inputs():
    if not sagekit.gpu_supports("int_flash"):
        pytest.skip("this build has no GPU kernel for int_flash")
    b, hq, hkv, n, d = 1, 4, 2, 256, 64
    g = torch.Generator(device="cuda").manual_seed(3)

    def ints(*shape):
        return torch.randint(-127, 128, shape, generator=g, device="cuda", dtype=torch.int8)

    def scales(*shape):
        return torch.rand(shape, generator=g, device="cuda") * 0.02 + 0.001

    q, k, v = ints(b, hq, n, d), ints(b, hkv, n, d), ints(b, hkv, n, d)
    q_scale, k_scale, v_scale = scales(b, hq, n), scales(b, hkv, n), scales(b, hkv)
    expected = sagekit.sageattn(q, k, v, recipe="int_flash", q_scale=q_scale, k_scale=k_scale,
                                v_scale=v_scale, out_dtype=torch.bfloat16)
    kv = sagekit.quantize_kv(k, v, recipe="int_flash", k_scale=k_scale, v_scale=v_scale)
    out = sagekit.sageattn_quantized_kv(q, kv, q_scale=q_scale, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    _same(out, expected)


@needs_gpu
def test_one_quantization_serves_many_queries():
    q, k, v = _qkv(b=1, hq=8, hkv=2, nq=256, nkv=1024, seed=1)
    kv = sagekit.quantize_kv(k, v, recipe={"base": "sage2_8b"})
    before = kv.workspace.clone()
    for seed, nq in ((2, 256), (3, 1), (4, 1024), (5, 77)):
        qi = _qkv(b=1, hq=8, hkv=2, nq=nq, nkv=8, seed=seed)[0]
        for causal in (False, True):
            _same(sagekit.sageattn_quantized_kv(qi, kv, is_causal=causal),
                  sagekit.sageattn(qi, k, v, is_causal=causal, recipe="sage2_8b"))
    torch.cuda.synchronize()
    assert torch.equal(kv.workspace, before)  # the attention step only reads the workspace


@needs_gpu
def test_workspace_is_a_uint8_tensor_of_kv_workspace_bytes():
    q, k, v = _qkv(b=2, hq=4, hkv=2, nq=64, nkv=300, d=64)
    kv = sagekit.quantize_kv(k, v)
    assert kv.workspace.dtype == torch.uint8 and kv.workspace.device == k.device
    assert kv.workspace.numel() == sagekit._C.kv_workspace_bytes(2, 2, 300, 64, "sage2_8b")
    assert kv.workspace.data_ptr() % 256 == 0
    assert (kv.layout, kv.recipe) == ("HND", "auto") and kv.k is k and kv.v is v


@needs_gpu
def test_two_step_fake_implementations_match_the_real_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv(b=2, hq=8, hkv=2, nq=200, nkv=300, d=64, layout="NHD")
    qkv_args = ("NHD", "sage2_8b", None, None)
    workspace = torch.ops.sagekit.quantize_kv(k, v, *qkv_args)
    attn_args = ("NHD", True, -1, -1, None, "sage2_8b", True, None, None, None, None)
    out, lse = torch.ops.sagekit.attention_from_quantized_kv(q, k, v, workspace, *attn_args)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        fws = torch.ops.sagekit.quantize_kv(fk, fv, *qkv_args)
        fout, flse = torch.ops.sagekit.attention_from_quantized_kv(fq, fk, fv, fws, *attn_args)
    for fake, real in ((fws, workspace), (fout, out), (flse, lse)):
        assert fake.shape == real.shape and fake.dtype == real.dtype
        assert fake.stride() == real.stride() and fake.device == real.device
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.sagekit.quantize_kv.default, (k, v) + qkv_args,
                          test_utils=checks)
    torch.library.opcheck(torch.ops.sagekit.attention_from_quantized_kv.default,
                          (q, k, v, workspace) + attn_args, test_utils=checks)


@needs_gpu
def test_two_step_torch_compile_fullgraph_has_no_graph_break():
    torch._dynamo.reset()
    q, k, v = _qkv(b=1, hq=8, hkv=2, nq=256, nkv=384, seed=9)

    def block(q, k, v):
        kv = sagekit.quantize_kv(k * 1.0, v, recipe={"base": "sage2_8b"})
        y = sagekit.sageattn_quantized_kv(q, kv, is_causal=True)
        z, lse = sagekit.sageattn_quantized_kv(q + 1.0, kv, return_lse=True)
        return y.float().sum(-1) + z.float().sum(-1) + lse

    compiled = torch.compile(block, fullgraph=True)  # raises on any graph break
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), atol=1e-2, rtol=1e-3)
    explanation = torch._dynamo.explain(block)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    # A KV cache growing by a few tokens per call: dynamic shapes, one graph, same results.
    torch._dynamo.reset()
    grown = torch.compile(block, fullgraph=True, dynamic=True)
    for nkv in (384, 400, 513):
        _, kn, vn = _qkv(b=1, hq=8, hkv=2, nq=8, nkv=nkv, seed=nkv)
        torch.testing.assert_close(grown(q, kn, vn), block(q, kn, vn), atol=1e-2, rtol=1e-3)


@needs_gpu
def test_two_step_argument_errors_on_the_gpu():
    q, k, v = _qkv(b=1, hq=4, hkv=2, nq=128, nkv=128, d=64)
    kv = sagekit.quantize_kv(k, v)
    check("q", sagekit.sageattn_quantized_kv, q.bfloat16(), kv)
    check("q", sagekit.sageattn_quantized_kv, q[..., :32].contiguous(), kv)
    check("q", sagekit.sageattn_quantized_kv, q.cpu(), kv)
    check("kv", sagekit.sageattn_quantized_kv, q, kv.workspace)
    check("k", sagekit.quantize_kv, k[..., :44].contiguous(), v[..., :44].contiguous())  # no kernel
    check("v", sagekit.quantize_kv, k, v[:, :, :64])          # tokens differ from k's
    with pytest.raises(sagekit.ArgumentError) as info:
        sagekit.quantize_kv(k, v, recipe="sage3_fp4")         # no sm_90 kernel
    assert info.value.argument.startswith("recipe")
    assert sagekit.gpu_supports("sage2_8b") and not sagekit.gpu_supports("sage3_fp4")
    # At the op level: a workspace too small for these K/V is refused by name.
    args = ("HND", False, -1, -1, None, "auto", False, None, None, None, None)
    check("workspace", torch.ops.sagekit.attention_from_quantized_kv, q, k, v,
          kv.workspace[:256], *args)
    # K/V longer than the ones quantized would need a larger workspace.
    long_k = torch.cat([k, k], dim=2)
    check("workspace", torch.ops.sagekit.attention_from_quantized_kv, q, long_k, long_k,
          kv.workspace, *args)


@needs_gpu
def test_two_steps_run_on_the_current_stream_without_host_sync():
    q, k, v = _qkv(b=1, hq=4, hkv=4, nq=256, nkv=512, seed=10)
    k_new = torch.randn_like(k)
    sagekit.sageattn_quantized_kv(q, sagekit.quantize_kv(k, v))  # warm-up
    expected = sagekit.sageattn(q, k_new, v, recipe="sage2_8b")  # the two steps' "auto"
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        with torch.cuda.stream(side):
            # The side stream is held up before it writes k; a quantize_kv launched on any
            # other stream would read the old k.
            torch.cuda._sleep(200_000_000)
            k.copy_(k_new)
            kv = sagekit.quantize_kv(k, v)
            out = sagekit.sageattn_quantized_kv(q, kv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    _same(out, expected)
