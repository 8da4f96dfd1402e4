"""V with a head dim of its own on the GPU (issue 34: DeepSeek MLA's prefill, Q/K 192 and V 128):
sageattn, the SDPA drop-in, the two-step path, packed batches, torch.compile, and the refusals
(the backward, the reference's compat API).

Every test needs a GPU of compute capability 9.0, torch and a CUDA build of sagekit; elsewhere
each one is skipped with that reason (shown by `pytest -rs`).
"""

import pytest

import sagekit
from conftest import HAS_TORCH, check_argument_error, cosine, needs_gpu, rel_l1

pytestmark = needs_gpu

if HAS_TORCH:
    import torch
    import torch.nn.functional as F


def _qkv(d, dv, b=1, hq=4, hkv=2, nq=300, nkv=260, dtype=None, seed=0):
    dtype = dtype or torch.float16
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(h, n, dim, offset=0.0):
        return (torch.randn((b, h, n, dim), generator=g, device="cuda") + offset).to(dtype)

    return make(hq, nq, d), make(hkv, nkv, d, offset=1.0), make(hkv, nkv, dv)


def _np(t):
    return t.detach().float().cpu().numpy()


def _supported(*dims):
    return all(d in sagekit.gpu_head_dims() for d in dims)


@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_matches_simulate_and_exact(d, dv, causal, dtype):
    if not _supported(d, dv):
        pytest.skip(f"this build has no kernel for head dims {d} and {dv}")
    dt = getattr(torch, dtype)
    q, k, v = _qkv(d, dv, dtype=dt)
    out, lse = sagekit.sageattn(q, k, v, is_causal=causal, return_lse=True)
    assert out.shape == (1, 4, 300, dv) and out.dtype == dt
    assert lse.shape == (1, 4, 300)
    sim, sim_lse = sagekit.simulate(q.cpu(), k.cpu(), v.cpu(), recipe="auto", is_causal=causal,
                                    return_lse=True)
    ref = sagekit.exact(q.cpu(), k.cpu(), v.cpu(), is_causal=causal)
    assert sim.shape == ref.shape == (1, 4, 300, dv)
    if not causal:  # (torch aligns a causal mask top-left, sagekit bottom-right)
        # The default scale is Q/K's 1/sqrt(d): torch SDPA's convention too.
        sdpa = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                              v.double().repeat_interleave(2, 1))
        assert cosine(ref.numpy(), _np(sdpa)) > 0.99999
    assert cosine(_np(out), sim.numpy()) > 0.9999
    assert rel_l1(_np(out), sim.numpy()) < 0.01
    torch.testing.assert_close(lse.cpu(), sim_lse, atol=1e-2, rtol=1e-3)
    assert cosine(_np(out), ref.numpy()) > 0.99


def test_sdpa_drop_in_and_two_step_path_take_v_head_dim():
    if not _supported(192, 128):
        pytest.skip("this build has no d = 256 tile")
    q, k, v = _qkv(192, 128, hq=2, hkv=2, seed=3)
    out = sagekit.scaled_dot_product_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.shape == ref.shape == (1, 2, 300, 128)
    assert cosine(_np(out), _np(ref)) > 0.99
    kv = sagekit.quantize_kv(k, v)
    torch.testing.assert_close(sagekit.sageattn_quantized_kv(q, kv), sagekit.sageattn(q, k, v),
                               atol=0, rtol=0)


def test_packed_batch_equals_dense_calls_per_sequence():
    if not _supported(192, 128):
        pytest.skip("this build has no d = 256 tile")
    lengths = [(70, 90), (1, 33), (200, 150)]
    seqs = [_qkv(192, 128, hq=4, hkv=2, nq=nq, nkv=nk, seed=10 + i) for i, (nq, nk) in enumerate(lengths)]
    pack = [torch.cat([s[j][0].transpose(0, 1) for s in seqs]) for j in range(3)]  # [total, h, d]
    cu_q = torch.tensor([0, 70, 71, 271], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 123, 273], dtype=torch.int32, device="cuda")
    out = sagekit.sageattn_varlen(*pack, cu_q, cu_k, 200, 150, causal=True)
    assert out.shape == (271, 4, 128)
    for i, (q, k, v) in enumerate(seqs):
        dense = sagekit.sageattn(q, k, v, is_causal=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[int(cu_q[i]):int(cu_q[i + 1])], dense, atol=0, rtol=0)


def test_torch_compile_and_fake_shapes():
    if not _supported(192, 128):
        pytest.skip("this build has no d = 256 tile")
    torch._dynamo.reset()
    q, k, v = _qkv(192, 128, hq=2, hkv=2, nq=128, nkv=128, seed=5)
    compiled = torch.compile(lambda q, k, v: sagekit.sageattn(q, k, v) * 1.0, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), sagekit.sageattn(q, k, v), atol=0, rtol=0)
    torch.library.opcheck(torch.ops.sagekit.attention.default,
                          (q, k, v, "HND", False, -1, -1, None, "auto", True, None, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_backward_and_compat_refuse_a_v_head_dim_of_their_own():
    q, k, v = _qkv(128, 64, hq=2, hkv=2, nq=64, nkv=64, dtype=torch.bfloat16)
    q.requires_grad_(True)
    check_argument_error("v", sagekit.sageattn, q, k, v, recipe="sagebwd")
    from sagekit import compat

    check_argument_error("v", compat.sageattn, q.detach(), k, v)
