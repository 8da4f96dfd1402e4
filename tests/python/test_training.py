"""Training through sagekit: loss.backward() with recipe="sagebwd" (the registered autograd
formulas of torch.ops.sagekit.attention_for_training, the forward sageattn calls where autograd
records it, which saves out and the rows' base-2 log-sums L2, and of torch.ops.sagekit.attention,
which runs the forward again; both call torch.ops.sagekit.attention_backward, the C++
attention_backward).

The binding and argument tests run anywhere (NumPy, or torch on the CPU); the autograd
wiring is traced on meta tensors (no device: the ops' fake implementations), so any machine
with torch checks that a training step records the right nodes, shapes and dtypes and traces
as one graph each way under torch.compile; and with the simulator standing in as both ops'
CPU kernels (a scoped registration), the formula runs on real values, eager and compiled, and
gives simulate_backward's gradients bit for bit. Everything on the GPU kernels needs a GPU of
compute capability 9.0 and skips visibly elsewhere (needs_gpu).
"""

import math

import pytest

import sagekit
from conftest import (HAS_TORCH, check_argument_error, cosine, needs_gpu, needs_numpy,
                      needs_torch, random_qkv)

if HAS_TORCH:
    import torch
    import torch.nn.functional as F


# ---- the bindings (NumPy only; any build) ---------------------------------------------------

@needs_numpy
def test_binding_backward_entry_points():
    import numpy as np

    C = sagekit._C
    q, k, v = random_qkv((1, 4, 64, 64), (1, 2, 64, 64))
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    args = (q, k, v, q, dq, dk, dv)
    check_argument_error("layout", C.attention_backward, *args, layout="HDN")
    check_argument_error("recipe", C.attention_backward, *args, recipe="sage4")
    check_argument_error("recipe.pv_accum", C.attention_backward, *args,
                         recipe="sagebwd,pv_accum=fp64")
    with pytest.raises(TypeError):  # the options are keyword-only
        C.attention_backward(*args, None, None, "HND")
    # Host arrays reach the library's checks, which want device memory (a CPU build: no kernels),
    # with or without the deterministic keyword.
    where = "q" if sagekit.cuda_built else "device"
    for entry in (C.backward_workspace_bytes, C.attention_backward):
        check_argument_error(where, entry, *args)
        check_argument_error(where, entry, *args, deterministic=True)
    with pytest.raises(TypeError):  # a bool, not a truthy value
        C.attention_backward(*args, deterministic="yes")
    assert C.has_backward("sagebwd") and C.has_backward("sagebwd,dp_format=int8")
    assert not C.has_backward("sage2_8b") and not C.has_backward("int_flash")
    for name in ("sagebwd", "sagebwd_block"):  # dS per token, dS per tile: a kernel each
        assert C.has_backward(name)
        assert C.gpu_supports_backward(name) is sagekit.cuda_built
        assert sagekit.gpu_supports_backward(name) is sagekit.cuda_built
    assert C.gpu_supports_backward("sage2_8b") is False                # no backward at all
    assert C.gpu_supports_backward("sagebwd,dp_format=int8") is False  # simulator only


@needs_numpy
def test_binding_saved_forward_entry_points():
    # attention_for_training (the forward that also writes L2) and the lse2 keyword of the
    # backward's entry points: each argument named where it is wrong, in any build.
    import numpy as np

    C = sagekit._C
    q, k, v = random_qkv((1, 4, 64, 64), (1, 2, 64, 64))
    out, l2 = np.empty_like(q), np.empty((1, 4, 64), dtype=np.float32)
    check_argument_error("lse2", C.attention_for_training, q, k, v, out, None)
    check_argument_error("out", C.attention_for_training, q, k, v, None, l2)
    check_argument_error("layout", C.attention_for_training, q, k, v, out, l2, layout="HDN")
    check_argument_error("recipe", C.attention_for_training, q, k, v, out, l2, recipe="sage4")
    with pytest.raises(TypeError):  # the options are keyword-only
        C.attention_for_training(q, k, v, out, l2, None, "HND")
    # Host arrays reach the library's checks (which want device memory), or a CPU build says
    # it has no kernels.
    where = "q" if sagekit.cuda_built else "device"
    check_argument_error(where, C.attention_for_training, q, k, v, out, l2)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    args = (q, k, v, q, dq, dk, dv)
    for entry in (C.attention_backward, C.backward_workspace_bytes):
        check_argument_error("lse2", entry, *args, out, lse2="l2")  # not an array
        check_argument_error(where, entry, *args, out, lse2=l2)
    # With lse2, out is read, not written: a read-only array is accepted there.
    frozen = out.copy()
    frozen.setflags(write=False)
    check_argument_error(where, C.backward_workspace_bytes, *args, frozen, lse2=l2)
    check_argument_error("out", C.backward_workspace_bytes, *args, frozen)  # written without lse2


# ---- what the backward refuses, before any GPU work (torch on the CPU) ----------------------

@needs_torch
@pytest.mark.parametrize("recipe,argument", [
    ("sage2_8b", "recipe"), ("auto", "recipe"), ("int_flash", "recipe"),
    ("sage2_8b_balanced", "recipe"), ("sagebwd,pv_accum=fp64", "recipe.pv_accum")])
def test_backward_refuses_recipes_without_one_by_name(recipe, argument):
    from sagekit import ops

    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    message = check_argument_error(argument, ops._attention_backward_body, q, q, q, q, "HND",
                                   False, -1, -1, None, recipe)
    if argument == "recipe":
        assert "has no backward; use recipe='sagebwd'" in message


@needs_torch
def test_backward_refuses_a_sliding_window_by_name():
    from sagekit import ops

    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    for window in ((8, 0), (-1, 8), (8, 8), (0, -1)):
        check_argument_error("window_size", ops._attention_backward_body, q, q, q, q, "HND",
                             True, window[0], window[1], None, "sagebwd")
    # No window, and (-1, 0), which is the causal mask, are what the backward computes.
    assert ops.check_backward_options(-1, -1, False, "sagebwd") is False
    assert ops.check_backward_options(-1, -1, True, "sagebwd") is True
    assert ops.check_backward_options(-1, 0, False, "sagebwd") is True


@needs_torch
def test_backward_takes_the_saved_forward_as_a_pair():
    # out and lse2 come together: out alone would be written (the forward again), an input of
    # an op that mutates nothing; lse2 alone has no output to read.
    from sagekit import ops

    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    l2 = torch.zeros(1, 2, 64)
    args = (q, q, q, q, "HND", False, -1, -1, None, "sagebwd")
    check_argument_error("lse2", ops._attention_backward_body, *args, q, None)
    check_argument_error("out", ops._attention_backward_body, *args, None, l2)


@needs_torch
def test_saves_forward_only_where_the_gpu_backward_runs_the_call():
    from sagekit import ops

    bf16, f16 = torch.bfloat16, torch.float16
    built = sagekit.cuda_built  # a CPU build has no sm_90 backward
    assert ops.saves_forward(bf16, "sagebwd", -1, -1) is built
    assert ops.saves_forward(f16, "sagebwd_block", -1, 0) is built  # (-1, 0): the causal mask
    for dtype, recipe, window in ((f16, "sagebwd", (16, 0)), (f16, "sagebwd", (-1, 8)),
                                  (torch.float32, "sagebwd", (-1, -1)), (f16, "auto", (-1, -1)),
                                  (f16, "sage2_8b", (-1, -1)), (f16, "sagebwd,dp_format=int8", (-1, -1)),
                                  (f16, "sage4", (-1, -1))):  # invalid: the forward names it
        assert ops.saves_forward(dtype, recipe, *window) is False, (dtype, recipe, window)


@needs_torch
@pytest.mark.parametrize("grad,requires,scaled,expected", [
    (True, True, False, True), (False, True, False, False), (True, False, False, False),
    (True, True, True, False)])
def test_only_a_call_autograd_records_takes_the_training_op(monkeypatch, grad, requires, scaled,
                                                            expected):
    # sageattn's call (ops.call_attention_trainable): the training op where autograd records the
    # call, so inference (no_grad, or inputs that need no grad) writes no L2; prequantized
    # inputs (scales) never train.
    from sagekit import ops

    seen = []

    def training(*args):
        seen.append("training")
        return args[0].new_empty(args[0].shape), args[0].new_empty((0,)), args[0].new_empty((0,))

    def plain(*args):
        seen.append("plain")
        return args[0].new_empty(args[0].shape), args[0].new_empty((0,))

    monkeypatch.setattr(ops, "attention_for_training", training)
    monkeypatch.setattr(ops, "call_attention", plain)
    q = _meta((1, 2, 64, 64), requires_grad=requires)
    scale = _meta((1, 2, 1), dtype=torch.float32, requires_grad=False) if scaled else None
    with torch.set_grad_enabled(grad):
        ops.call_attention_trainable(q, q, q, "HND", False, -1, -1, None, "sagebwd", False,
                                     scale, scale, scale, None)
    assert seen == ["training" if expected else "plain"]


@needs_torch
def test_backward_body_reaches_the_binding_with_its_keywords(monkeypatch):
    # The op's body up to the library on CPU tensors (the CUDA-only steps stubbed): the binding
    # takes every keyword the body passes (a wrong one would be a TypeError here) and its own
    # checks answer, naming the argument: 'device' in a build without CUDA, and host memory
    # refused for q otherwise. The output gradient, an expanded scalar as out.sum() gives,
    # is densified first.
    import contextlib

    from sagekit import ops

    monkeypatch.setattr(ops, "_require_cuda_build", lambda: None)
    monkeypatch.setattr(ops, "_on_device", lambda device: contextlib.nullcontext(0))
    q = torch.randn(1, 4, 64, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    dout = torch.ones((), dtype=torch.float32).expand(q.shape)
    assert ops._gpu_view(dout.to(q.dtype)).stride() == q.stride()
    assert ops._gpu_view(q.transpose(1, 2)).data_ptr() == q.data_ptr()  # read in place
    check_argument_error("q" if sagekit.cuda_built else "device", ops._attention_backward_body,
                         q, k, k, dout, "HND", True, -1, -1, 0.125, "sagebwd")
    # The saved forward's out and L2 reach it too (its lse2 keyword).
    check_argument_error("q" if sagekit.cuda_built else "device", ops._attention_backward_body,
                         q, k, k, dout, "HND", True, -1, -1, 0.125, "sagebwd", q,
                         torch.zeros(1, 4, 64))
    # No keys: the output is 0 whatever q is, so are the gradients (the library is not called).
    empty = k[:, :, :0]
    dq, dk, dv = ops._attention_backward_body(q, empty, empty, dout, "HND", False, -1, -1, None,
                                              "sagebwd")
    assert dq.shape == q.shape and not dq.any() and dk.shape == empty.shape


@needs_torch
@pytest.mark.parametrize("saved", [False, True])
def test_training_forward_body_reaches_the_binding_with_its_keywords(monkeypatch, saved):
    # The training op's body on CPU tensors (CUDA-only steps stubbed): with L2 saved it calls
    # attention_for_training, otherwise attention; either binding takes every keyword.
    import contextlib

    from sagekit import ops

    monkeypatch.setattr(ops, "_require_cuda_build", lambda: None)
    monkeypatch.setattr(ops, "_on_device", lambda device: contextlib.nullcontext(0))
    monkeypatch.setattr(ops, "resolve_auto", lambda recipe, device, two_step=False: recipe)
    monkeypatch.setattr(ops, "_gpu_backward", lambda recipe: saved)
    q = torch.randn(1, 4, 64, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    for window in ((-1, -1), (-1, 0)):
        check_argument_error("q" if sagekit.cuda_built else "device",
                             ops._attention_for_training_body, q, k, k, "HND", False, *window,
                             0.125, "sagebwd", True)


@needs_torch
def test_backward_follows_torch_deterministic_algorithms(monkeypatch):
    # The op's body up to the binding (stubbed): its deterministic argument reaches the library,
    # and torch's switch turns the deterministic mode on for a direct call of the op too
    # (warn_only included: the deterministic backward exists, so nothing warns or raises).
    import contextlib
    import warnings

    from sagekit import ops

    asked = []

    class Binding:
        cuda_built = True

        @staticmethod
        def has_backward(recipe):
            return True

        @staticmethod
        def attention_backward(*args, **kwargs):
            asked.append(kwargs["deterministic"])

    monkeypatch.setattr(ops, "_C", Binding)
    monkeypatch.setattr(ops, "_require_cuda_build", lambda: None)
    monkeypatch.setattr(ops, "_on_device", lambda device: contextlib.nullcontext(0))
    monkeypatch.setattr(ops, "_allocate", lambda device: None)
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    args = (q, q, q, q, "HND", False, -1, -1, None, "sagebwd", None, None)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for switch, warn_only, argument in ((False, False, False), (False, False, True),
                                                (True, False, False), (True, True, False)):
                torch.use_deterministic_algorithms(switch, warn_only=warn_only)
                ops._attention_backward_body(*args, argument)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert asked == [False, True, True, True]


# ---- the autograd wiring, traced on meta tensors (torch; no GPU) ----------------------------

def _meta(shape, dtype=None, requires_grad=True):
    return torch.empty(shape, device="meta", dtype=dtype or torch.bfloat16,
                       requires_grad=requires_grad)


def _op(q, k, v, layout="HND", causal=True, recipe="sagebwd", return_lse=False, q_scale=None,
        k_scale=None, v_scale=None):
    return torch.ops.sagekit.attention(q, k, v, layout, causal, -1, -1, None, recipe, return_lse,
                                       q_scale, k_scale, v_scale, None)


@needs_torch
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_autograd_records_the_backward_with_the_inputs_shapes(layout):
    b, hq, hkv, nq, nkv, d = 2, 8, 2, 100, 300, 64

    def shape(h, n):
        return (b, h, n, d) if layout == "HND" else (b, n, h, d)

    q, k, v = _meta(shape(hq, nq)), _meta(shape(hkv, nkv)), _meta(shape(hkv, nkv))
    out, lse = _op(q, k, v, layout=layout, return_lse=True)
    assert out.requires_grad and out.grad_fn is not None
    # The LSE is not differentiable (as torch's flash/efficient SDPA ops' logsumexp).
    assert not lse.requires_grad
    (out.float() * 2).sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype


@pytest.fixture(params=[False, True], ids=["rerun", "saved"])
def saved(request, monkeypatch):
    """Whether sagekit::attention_for_training saves the forward (its L2) for sagebwd: True as
    on a CUDA build, False as a CPU build answers (ops._gpu_backward stubbed for the test)."""
    from sagekit import ops

    def gpu_backward(recipe):  # sagebwd's configuration, as the sm_90 backward's
        return request.param and recipe in ("sagebwd", "sagebwd_block")

    monkeypatch.setattr(ops, "_gpu_backward", gpu_backward)
    return request.param


def _training_op(q, k, v, layout="HND", causal=True, recipe="sagebwd", return_lse=False,
                 window=(-1, -1)):
    return torch.ops.sagekit.attention_for_training(q, k, v, layout, causal, *window, None,
                                                    recipe, return_lse)


@needs_torch
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_training_op_saves_out_and_l2_for_its_backward(saved, layout):
    b, hq, hkv, nq, nkv, d = 2, 8, 2, 100, 300, 64

    def shape(h, n):
        return (b, h, n, d) if layout == "HND" else (b, n, h, d)

    q, k, v = _meta(shape(hq, nq)), _meta(shape(hkv, nkv)), _meta(shape(hkv, nkv))
    out, lse, l2 = _training_op(q, k, v, layout=layout, return_lse=True)
    assert out.requires_grad and not lse.requires_grad and not l2.requires_grad
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, nq)
    assert l2.dtype == torch.float32 and l2.shape == ((b, hq, nq) if saved else (0,))
    kept = out.grad_fn.saved_tensors
    assert len(kept) == (5 if saved else 3)  # q, k, v (, out, l2)
    if saved:
        assert kept[3].shape == out.shape and kept[4].shape == l2.shape
    (out.float() * 2).sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype
    # What saves_forward refuses (a window, a recipe without an sm_90 backward) has no L2.
    for recipe, window in (("sagebwd", (16, 0)), ("sage2_8b", (-1, -1))):
        assert _training_op(q, k, v, layout=layout, recipe=recipe, window=window)[2].shape == (0,)


@needs_torch
def test_autograd_gives_gradients_only_where_asked_and_through_views():
    # q, k, v as views of one fused projection (a strided, non-contiguous layout): the
    # gradient reaches the fused tensor with its shape.
    qkv = _meta((2, 128, 3, 4, 64))
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    out, _ = _op(q, k, v)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape
    q, k, v = _meta((1, 4, 64, 64)), _meta((1, 4, 64, 64), requires_grad=False), \
        _meta((1, 4, 64, 64), requires_grad=False)
    out, _ = _op(q, k, v)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad is None and v.grad is None


@needs_torch
def test_prequantized_scales_are_not_differentiable():
    q = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.int8)
    scale = _meta((1, 2, 1), dtype=torch.float32)
    out, _ = _op(q, q, q, recipe="int_flash", causal=False, q_scale=scale,
                 k_scale=scale.detach(), v_scale=scale.detach())
    check_argument_error("q_scale", out.float().sum().backward)


@needs_torch
@pytest.mark.parametrize("entry", ["call_attention", "call_attention_trainable"])
def test_training_step_traces_as_one_graph_each_way(saved, entry):
    # torch.compile(fullgraph=True) through the front end's op call: AOTAutograd traces the
    # registered formula, so the forward graph has the forward op (sageattn's call,
    # call_attention_trainable: sagekit.attention_for_training) and the backward graph
    # sagekit.attention_backward, given the saved out and L2 where the forward saved them,
    # and no break.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from sagekit import ops

    torch._dynamo.reset()
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    def step(q, k, v, w):
        y, _ = getattr(ops, entry)(q, k, v, "NHD", True, -1, -1, None, "sagebwd", False, None,
                                   None, None, None)
        return (y.float() * w).sum()

    q, k, v = _meta((1, 128, 4, 64)), _meta((1, 128, 2, 64)), _meta((1, 128, 2, 64))
    w = torch.empty(1, 128, 4, 64, device="meta")
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    loss = torch.compile(step, backend=backend, fullgraph=True)(q, k, v, w)
    loss.backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape

    def targets(name):
        return [str(n.target).removesuffix(".default") for n in graphs[name].graph.nodes
                if n.op == "call_function"]

    trainable = entry == "call_attention_trainable"
    forward_op = "sagekit.attention_for_training" if trainable else "sagekit.attention"
    assert targets("forward").count(forward_op) == 1, targets("forward")
    assert targets("backward").count("sagekit.attention_backward") == 1, targets("backward")
    (node,) = [n for n in graphs["backward"].graph.nodes
               if str(n.target) == "sagekit.attention_backward.default"]
    named = dict(zip(("out", "lse2", "deterministic"), node.args[10:]), **node.kwargs)
    given = [named[name] for name in ("out", "lse2") if named.get(name) is not None]
    assert len(given) == (2 if trainable and saved else 0), node.format_node()
    assert named.get("deterministic", False) is False, node.format_node()  # torch's switch is off
    torch._dynamo.reset()


# ---- the autograd formula on CPU values (torch; no GPU) ------------------------------------

class _Calls(list):
    """The backward's calls' paths ("saved" or "rerun"), and in .deterministic each call's
    deterministic argument."""

    def __init__(self):
        super().__init__()
        self.deterministic = []


@pytest.fixture
def simulator_kernels():
    """CPU kernels for the three ops, from the simulator, for the duration of one test (a
    scoped library registration, removed afterwards): the registered autograd formulas then
    run on real values anywhere, and their gradients must be simulate_backward's exactly.
    The training forward's L2 is a stand-in (the natural-log LSE in base 2: only the GPU
    kernel computes the real one, and the simulator's backward does not read it); the
    backward checks that it receives exactly the saved out and L2, and records each call's
    path in the yielded list ("saved" or "rerun") and its deterministic argument in the list's
    .deterministic."""
    from sagekit import ops

    paths = _Calls()

    def simulated(q, k, v, layout, is_causal, wl, wr, scale, recipe):
        out, lse = sagekit.simulate(q, k, v, recipe=recipe, is_causal=is_causal, scale=scale,
                                    layout=layout, return_lse=True, window_size=(wl, wr))
        return out.to(q.dtype), lse

    def forward(q, k, v, layout, is_causal, wl, wr, scale, recipe, return_lse, qs, ks, vs, od):
        out, lse = simulated(q, k, v, layout, is_causal, wl, wr, scale, recipe)
        return out, lse if return_lse else lse.new_empty((0,))

    def training_forward(q, k, v, layout, is_causal, wl, wr, scale, recipe, return_lse):
        out, lse = simulated(q, k, v, layout, is_causal, wl, wr, scale, recipe)
        saved = ops.saves_forward(q.dtype, recipe, wl, wr)
        l2 = lse * math.log2(math.e) if saved else lse.new_empty((0,))
        return out, lse if return_lse else lse.new_empty((0,)), l2

    def backward(q, k, v, dout, layout, is_causal, wl, wr, scale, recipe, out=None, lse2=None,
                 deterministic=False):
        causal = ops.check_backward_options(wl, wr, is_causal, recipe)
        paths.deterministic.append(deterministic)
        if lse2 is not None:
            # The saved forward's, untouched: the forward's output and L2 of these inputs.
            want, lse = simulated(q, k, v, layout, causal, -1, -1, scale, recipe)
            torch.testing.assert_close(out, want, atol=0, rtol=0)
            torch.testing.assert_close(lse2, lse * math.log2(math.e), atol=0, rtol=0)
        paths.append("rerun" if lse2 is None else "saved")
        grads = sagekit.simulate_backward(q, k, v, dout.contiguous(), recipe=recipe,
                                          is_causal=causal, scale=scale, layout=layout)
        return tuple(g.to(q.dtype) for g in grads)

    with torch.library._scoped_library("sagekit", "IMPL") as lib:
        lib.impl("attention", forward, "CPU")
        lib.impl("attention_for_training", training_forward, "CPU")
        lib.impl("attention_backward", backward, "CPU")
        yield paths


@needs_torch
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("entry", ["call_attention", "call_attention_trainable"])
def test_autograd_formula_gives_the_simulators_gradients(simulator_kernels, saved, layout,
                                                         compiled, entry):
    from sagekit import ops

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)

    def make(h, n):
        shape = (1, h, n, 64) if layout == "HND" else (1, n, h, 64)
        return torch.randn(shape, generator=g).to(torch.bfloat16).requires_grad_(True)

    q, k, v = make(4, 80), make(2, 96), make(2, 96)
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16)

    def f(q, k, v):
        return getattr(ops, entry)(q, k, v, layout, True, -1, -1, 0.2, "sagebwd", True, None,
                                   None, None, None)

    out, lse = (torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f)(q, k, v)
    assert not lse.requires_grad
    out.backward(do)
    # sageattn's call (call_attention_trainable) saves the forward where the GPU backward runs
    # the recipe; the plain op always runs the forward again.
    assert simulator_kernels == ["saved" if saved and entry != "call_attention" else "rerun"]
    want = sagekit.simulate_backward(*(t.detach() for t in (q, k, v, do)), is_causal=True,
                                     scale=0.2, layout=layout)
    for t, w in zip((q, k, v), want):
        assert t.grad.dtype == torch.bfloat16
        torch.testing.assert_close(t.grad, w.to(torch.bfloat16), atol=0, rtol=0)
    torch._dynamo.reset()


@needs_torch
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("switch", [False, True])
def test_autograd_formulas_pass_torchs_deterministic_switch(simulator_kernels, saved, compiled,
                                                           switch):
    # Both formulas (the saved forward's and the re-running op's) give the backward op
    # torch.are_deterministic_algorithms_enabled() as its deterministic argument, eager and
    # compiled (where the backward graph holds it as a constant).
    from sagekit import ops

    torch._dynamo.reset()
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(switch)
        for entry in ("call_attention", "call_attention_trainable"):
            def f(q):
                return getattr(ops, entry)(q, q, q, "HND", True, -1, -1, None, "sagebwd", False,
                                           None, None, None, None)[0]

            out = (torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f)(q)
            out.float().sum().backward()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch._dynamo.reset()
    assert simulator_kernels.deterministic == [switch, switch]


@needs_torch
def test_autograd_formula_refuses_by_name_on_cpu_values(simulator_kernels, saved):
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16, requires_grad=True)
    for recipe in ("sage2_8b", "auto"):
        for op in (_op, _training_op):
            out = op(q, q, q, recipe=recipe)[0]  # the forward runs ("auto": simulate's reading)
            check_argument_error("recipe", out.float().sum().backward)  # the backward names it
    out, _ = torch.ops.sagekit.attention(q, q, q, "HND", True, 16, 0, None, "sagebwd", False,
                                         None, None, None, None)
    check_argument_error("window_size", out.float().sum().backward)
    out = _training_op(q, q, q, window=(16, 0))[0]
    check_argument_error("window_size", out.float().sum().backward)
    assert simulator_kernels == []  # every refusal came before the backward's work


# ---- on the GPU ----------------------------------------------------------------------------

def _qkv(b=1, hq=4, hkv=4, nq=256, nkv=256, d=64, dtype=None, seed=0, layout="HND"):
    dtype = dtype or torch.float16
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(h, n, offset=0.0):
        shape = (b, h, n, d) if layout == "HND" else (b, n, h, d)
        t = (torch.randn(shape, generator=g, device="cuda") + offset).to(dtype)
        return t.requires_grad_(True)

    return make(hq, nq), make(hkv, nkv, offset=1.0), make(hkv, nkv)


def _cpu(t):
    return t.detach().cpu()


def _grads(*ts):
    return tuple(t.grad for t in ts)


def _check_against_references(grads, q, k, v, do, causal, layout):
    """The GPU gradients against the simulator (cosine >= 0.99999, the C++ GPU tests' bound)
    and float64 (no worse than the recipe's own error on these inputs, plus the kernel's
    allowance, and the recipe's usual bars)."""
    args = (_cpu(q), _cpu(k), _cpu(v), _cpu(do))
    sim = sagekit.simulate_backward(*args, recipe="sagebwd", is_causal=causal, layout=layout)
    exact = sagekit.exact_backward(*args, is_causal=causal, layout=layout)
    for name, g, s, e, bar in zip(("dq", "dk", "dv"), grads, sim, exact, (0.995, 0.995, 0.999)):
        assert g.dtype == q.dtype and g.shape == s.shape, name
        g = g.float().cpu()
        assert torch.isfinite(g).all(), name
        # The kernel stores each gradient once in the inputs' dtype; so does this reference.
        s = s.to(q.dtype).float()
        assert cosine(g, s) >= 0.99999, f"{name} against the simulator: {cosine(g, s)}"
        recipe_err = 1 - cosine(s, e)
        assert 1 - cosine(g, e) <= 1.02 * recipe_err + 1e-5, f"{name} against float64"
        assert cosine(g, e) > bar, f"{name} against float64: {cosine(g, e)}"


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sagebwd_gradients_match_the_simulator_and_float64(dtype, causal, heads, layout):
    dtype = getattr(torch, dtype)
    for d in (64, 128):
        if d not in sagekit.gpu_head_dims():
            continue
        q, k, v = _qkv(hq=heads[0], hkv=heads[1], nq=200, nkv=320, d=d, dtype=dtype, layout=layout,
                       seed=d)
        do = torch.randn_like(q)
        out = sagekit.sageattn(q, k, v, is_causal=causal, layout=layout, recipe="sagebwd")
        out.backward(do)
        _check_against_references(_grads(q, k, v), q, k, v, do, causal, layout)


@needs_gpu
def test_gradients_of_strided_views_and_any_output_gradient():
    # q, k, v as views of one fused projection, [B, N, 3, H, D] -> three [B, H, N, D] views
    # (bench/training_parity.py's attention): the same gradients as contiguous copies.
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(2, 256, 3, 4, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    fused = qkv.clone().requires_grad_(True)
    q, k, v = (t.transpose(1, 2) for t in fused.unbind(2))
    assert not q.is_contiguous()
    sagekit.sageattn(q, k, v, is_causal=True, recipe="sagebwd").float().sum().backward()
    assert fused.grad.shape == fused.shape
    dense = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in qkv.unbind(2)]
    # out.sum()'s gradient is an expanded scalar (stride 0): the op copies it densely.
    sagekit.sageattn(*dense, is_causal=True, recipe="sagebwd").sum().backward()
    for i, t in enumerate(dense):
        got = fused.grad[:, :, i].transpose(1, 2)
        assert cosine(got.float().cpu(), t.grad.float().cpu()) >= 0.99999
        torch.testing.assert_close(got, t.grad, atol=2e-2, rtol=2e-2)
    # A transposed (non-contiguous) output gradient is read in place.
    q, k, v = _qkv(nq=128, nkv=128, seed=4)
    do = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    sagekit.sageattn(q, k, v, recipe="sagebwd").backward(do)
    _check_against_references(_grads(q, k, v), q, k, v, do.contiguous(), False, "HND")


@needs_gpu
def test_lse_is_returned_without_a_gradient():
    q, k, v = _qkv(nq=128, nkv=128, seed=5)
    out, lse = sagekit.sageattn(q, k, v, recipe="sagebwd", return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    (out.float().sum() + lse.sum()).backward()  # the LSE's term adds nothing
    first = _grads(q, k, v)
    for t in (q, k, v):
        t.grad = None
    sagekit.sageattn(q, k, v, recipe="sagebwd").float().sum().backward()
    for a, b in zip(first, _grads(q, k, v)):
        assert cosine(a.float().cpu(), b.float().cpu()) >= 0.99999


@needs_gpu
def test_other_recipes_raise_by_name_in_backward():
    q, k, v = _qkv(nq=128, nkv=128, seed=6)
    for recipe in ["auto"] + [r for r in ("sage2_8b", "sage2pp_8b") if sagekit.gpu_supports(r)]:
        out = sagekit.sageattn(q, k, v, recipe=recipe)  # the forward runs
        message = check_argument_error("recipe", out.float().sum().backward)
        assert "use recipe='sagebwd'" in message
    # A recipe with a backward that the sm_90 kernel does not implement: the library names it.
    out = sagekit.sageattn(q, k, v, recipe="sagebwd,dp_format=int8")
    check_argument_error("recipe", out.float().sum().backward)
    out = sagekit.sageattn(q, k, v, is_causal=True, window_size=(32, 0), recipe="sagebwd")
    check_argument_error("window_size", out.float().sum().backward)
    with torch.no_grad():  # inference with any recipe is untouched
        sagekit.sageattn(q, k, v, recipe="sage2_8b")


@needs_gpu
def test_sdpa_drop_in_and_patch_sdpa_train():
    q, k, v = _qkv(hq=8, hkv=2, nq=256, nkv=256, seed=7, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    out = sagekit.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                               recipe="sagebwd")
    out.backward(do)
    _check_against_references(_grads(q, k, v), q, k, v, do, True, "HND")
    # 3-D inputs [N, L, E] and a patched F.scaled_dot_product_attention.
    x = torch.randn(3, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    with sagekit.patch_sdpa(recipe="sagebwd") as stats:
        y = F.scaled_dot_product_attention(x, x * 0.5, x, is_causal=True)
    y.float().pow(2).sum().backward()
    assert stats.calls == 1 and x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    ref = x.detach().float().requires_grad_(True)
    F.scaled_dot_product_attention(ref, ref * 0.5, ref, is_causal=True).pow(2).sum().backward()
    assert cosine(x.grad.float().cpu(), ref.grad.cpu()) > 0.99


class _Attention(torch.nn.Module if HAS_TORCH else object):
    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        y = sagekit.sageattn(q, k, v, is_causal=True, layout="NHD", recipe="sagebwd")
        return self.proj(y.reshape(b, n, c))


@needs_gpu
def test_bf16_autocast_training_step():
    # bench/training_parity.py's pattern: the forward under bf16 autocast (q, k, v arrive in
    # bf16 from the projection), loss.backward() outside it.
    torch.manual_seed(0)
    model = _Attention().cuda()
    x = torch.randn(2, 256, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    reference = _Attention().cuda()
    reference.load_state_dict(model.state_dict())
    b, n, c = x.shape

    def sdpa_forward(x):
        q, k, v = reference.qkv(x).view(b, n, 3, 4, c // 4).unbind(2)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return reference.proj(y.transpose(1, 2).reshape(b, n, c))

    sdpa_forward(x).pow(2).mean().backward()
    for g, p in zip(grads, reference.parameters()):  # bf16 autocast and 8-bit attention
        assert cosine(g.cpu(), p.grad.cpu()) > 0.98


@needs_gpu
def test_torch_compile_fullgraph_training_step():
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = _Attention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)

    def step(model, x):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    eager_loss = step(model, x)
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    def loss_of(x):
        return model(x).float().pow(2).mean()

    compiled = torch.compile(loss_of, fullgraph=True)  # raises on any graph break
    loss = compiled(x)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, atol=1e-3, rtol=1e-3)
    for g, e in zip((p.grad for p in model.parameters()), eager):
        assert cosine(g.float().cpu(), e.float().cpu()) >= 0.999  # inductor rounds differently
    explanation = torch._dynamo.explain(loss_of)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()


@needs_gpu
def test_cuda_graph_capture_of_forward_and_backward():
    q, k, v = _qkv(hq=4, hkv=2, nq=256, nkv=256, seed=8)
    do = torch.randn_like(q)

    def step():
        out = sagekit.sageattn(q, k, v, is_causal=True, recipe="sagebwd")
        out.backward(do)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        for _ in range(2):
            step()
            for t in (q, k, v):
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    static = _grads(q, k, v)
    for seed in (9, 10):
        fresh = _qkv(hq=4, hkv=2, nq=256, nkv=256, seed=seed)
        with torch.no_grad():
            for t, f in zip((q, k, v), fresh):
                t.copy_(f)
            do.copy_(torch.randn_like(do))
        graph.replay()
        torch.cuda.synchronize()
        eager_out = sagekit.sageattn(*fresh, is_causal=True, recipe="sagebwd")
        eager_out.backward(do)
        torch.testing.assert_close(out, eager_out, atol=0, rtol=0)  # the forward is deterministic
        for got, want in zip(static, _grads(*fresh)):
            assert cosine(got.float().cpu(), want.float().cpu()) >= 0.99999


@needs_gpu
def test_no_host_synchronization_in_forward_and_backward():
    q, k, v = _qkv(nq=256, nkv=256, seed=11)
    do = torch.randn_like(q)
    sagekit.sageattn(q, k, v, recipe="sagebwd").backward(do)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for _ in range(3):
            sagekit.sageattn(q, k, v, is_causal=True, recipe="sagebwd").backward(do)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@needs_gpu
def test_backward_fake_matches_the_real_op():
    q, k, v = _qkv(hq=8, hkv=2, nq=200, nkv=300, seed=12, layout="NHD")
    args = (q.detach(), k.detach(), v.detach(), torch.randn_like(q), "NHD", True, -1, -1, None,
            "sagebwd")
    torch.library.opcheck(torch.ops.sagekit.attention_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))


# ---- the saved forward on the GPU: the same bits as running the forward again ---------------

def _bits(t):
    """t's bit patterns (an integer view), so that equality is of every bit (-0 != +0)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_saved_forward_gives_the_rerun_paths_bits(dtype, causal, layout):
    # attention_for_training's out and lse are sagekit::attention's bit for bit, and the
    # backward on its saved out and L2 is the backward that runs the forward again. With one
    # K/V tile (n_kv <= 128) and one query head per K/V head, no gradient element gets two fp32
    # atomic additions, so the backward is deterministic and every bit must agree; at
    # n = 1024, dk and dv still are (one query head per K/V head) and dq may differ only by
    # the order of its atomics across the K/V tiles' CTAs.
    dtype = getattr(torch, dtype)
    # The causal mask both ways: is_causal, and the window (-1, 0), which the training forward
    # runs as is_causal (the same bits).
    options = [(True, (-1, -1)), (False, (-1, 0))] if causal else [(False, (-1, -1))]
    eps = torch.finfo(dtype).eps
    for d in (64, 128):
        if d not in sagekit.gpu_head_dims():
            continue
        for nq, nkv in ((200, 128), (1024, 1024)):
            q, k, v = (t.detach() for t in _qkv(nq=nq, nkv=nkv, d=d, dtype=dtype, layout=layout,
                                                seed=d + nq))
            do = torch.randn_like(q)
            for is_causal, window in options:
                fwd = (q, k, v, layout, is_causal, *window, None, "sagebwd", True)
                out, lse, l2 = torch.ops.sagekit.attention_for_training(*fwd)
                ref_out, ref_lse = torch.ops.sagekit.attention(*fwd, None, None, None, None)
                assert l2.dtype == torch.float32 and l2.shape == lse.shape == (1, 4, nq)
                if not (causal and nq > nkv):  # else the first rows see no key
                    assert torch.isfinite(l2).all()
                assert torch.equal(_bits(out), _bits(ref_out)), (d, nq, is_causal, window)
                assert torch.equal(_bits(lse), _bits(ref_lse)), (d, nq, is_causal, window)
                bwd = (q, k, v, do, layout, is_causal, *window, None, "sagebwd")
                rerun = torch.ops.sagekit.attention_backward(*bwd)
                saved = torch.ops.sagekit.attention_backward(*bwd, out, l2)
                for name, a, b in zip(("dq", "dk", "dv"), saved, rerun):
                    case = (name, d, nq, is_causal, window)
                    if name != "dq" or nkv <= 128:
                        assert torch.equal(_bits(a), _bits(b)), case
                    else:  # the atomics' order: at most a rounding of the fp32 sum apart
                        assert cosine(a.float().cpu(), b.float().cpu()) >= 0.999999, case
                        torch.testing.assert_close(a, b, rtol=2 * eps,
                                                   atol=1e-3 * b.abs().max().item(), msg=str(case))
                torch.testing.assert_close(out, ref_out, atol=0, rtol=0)  # out was only read


@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_algorithms_give_the_same_gradient_bits(causal):
    # torch.use_deterministic_algorithms(True) runs the backward's deterministic mode: two
    # backward passes give every bit alike, dq summed over 8 K/V tiles and dk, dv over a GQA
    # group of 4, and the gradients still meet the simulator's and float64's bounds.
    d = 128 if 128 in sagekit.gpu_head_dims() else 64
    q, k, v = _qkv(hq=8, hkv=2, nq=1024, nkv=1024, d=d, seed=21)
    do = torch.randn_like(q)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    runs = []
    try:
        torch.use_deterministic_algorithms(True)
        for _ in range(2):
            sagekit.sageattn(q, k, v, is_causal=causal, recipe="sagebwd").backward(do)
            runs.append(_grads(q, k, v))
            for t in (q, k, v):
                t.grad = None
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(_bits(a), _bits(b)), name
    _check_against_references(runs[0], q, k, v, do, causal, "HND")


@needs_gpu
def test_sageattn_trains_through_the_saved_forward():
    # sageattn under autograd is sagekit::attention_for_training, which saves q, k, v, out and
    # L2; its gradients are the re-running op's, bit for bit (a deterministic shape, as above).
    q, k, v = _qkv(nq=200, nkv=128, seed=13)
    do = torch.randn_like(q)
    out = sagekit.sageattn(q, k, v, is_causal=True, recipe="sagebwd")
    assert "attention_for_training" in out.grad_fn.name(), out.grad_fn.name()
    assert len(out.grad_fn.saved_tensors) == 5  # q, k, v, out, l2
    out.backward(do)
    saved = _grads(q, k, v)
    for t in (q, k, v):
        t.grad = None
    ref, _ = torch.ops.sagekit.attention(q, k, v, "HND", True, -1, -1, None, "sagebwd", False,
                                         None, None, None, None)
    assert "attention_for_training" not in ref.grad_fn.name()
    assert torch.equal(_bits(out.detach()), _bits(ref.detach()))
    ref.backward(do)
    for name, a, b in zip(("dq", "dk", "dv"), saved, _grads(q, k, v)):
        assert torch.equal(_bits(a), _bits(b)), name
    # Inference writes no L2: no autograd node, so the plain op (or its body) ran.
    with torch.no_grad():
        assert sagekit.sageattn(q, k, v, recipe="sagebwd").grad_fn is None
    assert sagekit.sageattn(q.detach(), k.detach(), v.detach(), recipe="sagebwd").grad_fn is None
    # A recipe without an sm_90 backward trains through the same op with no L2, and its
    # backward names the recipe (test_other_recipes_raise_by_name_in_backward).
    out = sagekit.sageattn(q, k, v, recipe="sagebwd,dp_format=int8")
    assert len(out.grad_fn.saved_tensors) == 3


@needs_gpu
def test_training_fake_matches_the_real_op():
    q, k, v = (t.detach() for t in _qkv(hq=8, hkv=2, nq=200, nkv=300, seed=14, layout="NHD"))
    for recipe, window in (("sagebwd", (-1, -1)), ("sagebwd_block", (-1, 0)),
                           ("sagebwd", (16, 0)), ("sage2_8b", (-1, -1))):
        args = (q, k, v, "NHD", True, *window, None, recipe, True)
        torch.library.opcheck(torch.ops.sagekit.attention_for_training.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    out, _, l2 = torch.ops.sagekit.attention_for_training(q, k, v, "NHD", True, -1, -1, None,
                                                          "sagebwd", False)
    # The backward on the saved forward: out and l2 are read, never written (test_schema).
    args = (q, k, v, torch.randn_like(q), "NHD", True, -1, -1, None, "sagebwd", out, l2)
    torch.library.opcheck(torch.ops.sagekit.attention_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))
