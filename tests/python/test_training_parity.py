"""bench/training_parity.py's harness on the CPU (needs torch): the data split, and that two
runs with the same attention are bit-identical, so that a gap between SDPA and sagebwd is the
attention's and not the harness's (same initialization, same data order)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import HAS_TORCH, needs_gpu

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="needs torch")


def _harness():
    spec = importlib.util.spec_from_file_location("training_parity", ROOT / "bench" / "training_parity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["training_parity"] = module
    spec.loader.exec_module(module)
    return module


def test_docstrings_are_split_from_code():
    tp = _harness()
    code, docs = tp._split_docstrings('"""Module doc."""\n\ndef f():\n    """F doc."""\n    return 1\n')
    assert "Module doc." in docs and "F doc." in docs
    assert "doc." not in code and "return 1" in code


def test_same_attention_twice_gives_identical_curves():
    import torch

    tp = _harness()
    data = tp.corpus(max_files=60)
    assert all(len(data[s][k]) > 1_000 for s in ("code", "docs") for k in ("train", "val"))
    cfg = tp.Config(layers=1, heads=2, head_dim=16, context=64)
    pre = tp.Schedule(steps=12, batch=4, eval_every=6, eval_batches=2, warmup=4)
    fine = tp.Schedule(steps=6, batch=4, eval_every=6, eval_batches=2, warmup=2)
    sdpa = tp.attention_function("sdpa")
    result = tp.run_parity(cfg, pre, fine, {"a": sdpa, "b": sdpa}, torch.device("cpu"), data,
                           log=lambda s: None)
    runs = result["runs"]
    assert set(runs) == {"pretrain_a", "pretrain_b", "finetune_a", "finetune_b"}
    assert runs["pretrain_a"]["train_losses"] == runs["pretrain_b"]["train_losses"]
    assert runs["finetune_a"]["val_curve"] == runs["finetune_b"]["val_curve"]
    assert result["pretrain_gap"] == 0.0 and result["finetune_gap"] == 0.0
    # Training does something: the loss falls from ln(256) = 5.55 nats per byte.
    assert runs["pretrain_a"]["train_losses"][-1] < runs["pretrain_a"]["train_losses"][0] - 0.3
    # Fine-tuning starts from the pretrained checkpoint, not from scratch.
    assert runs["finetune_a"]["train_losses"][0] < runs["pretrain_a"]["train_losses"][0]


@needs_gpu
def test_sagebwd_trains_the_gpt_on_the_gpu():
    # The harness's sagebwd attention (sageattn(..., is_causal=True, recipe="sagebwd") on
    # strided views of the fused QKV projection, under bf16 autocast) through loss.backward():
    # a few steps beside SDPA from the same initialization and data.
    import torch

    tp = _harness()
    data = tp.corpus(max_files=60)
    cfg = tp.Config(layers=2, heads=2, head_dim=64, context=256)
    pre = tp.Schedule(steps=20, batch=4, eval_every=10, eval_batches=2, warmup=4)
    fine = tp.Schedule(steps=4, batch=4, eval_every=4, eval_batches=2, warmup=2)
    attentions = {"sdpa": tp.attention_function("sdpa"), "sagebwd": tp.attention_function("sagebwd")}
    result = tp.run_parity(cfg, pre, fine, attentions, torch.device("cuda"), data,
                           log=lambda s: None)
    sage = result["runs"]["pretrain_sagebwd"]["train_losses"]
    assert sage[-1] < sage[0] - 0.3  # it learns (train() raises on a non-finite loss)
    assert abs(result["pretrain_gap"]) < 0.05, result["pretrain_gap"]


def _gradients(attend, q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attend(*leaves).backward(dout)
    return [t.grad for t in leaves]


def test_the_backward_emulation_brackets_sdpa_and_orders_the_granularities():
    """bench/sagebwd_emulation.py, the model behind the per-token dS decision: with dS left
    exact it is SDPA's backward up to Q/K's INT8 codes; per token is closer than per tile; the
    forward is SDPA's."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "bench"))
    from sagebwd_emulation import emulated_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 300, 64, generator=gen, dtype=torch.float64) for _ in range(4))
    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    ref = _gradients(sdpa, q, k, v, dout)
    torch.testing.assert_close(emulated_attention("block")(q, k, v), sdpa(q, k, v), rtol=0, atol=0)

    def rel_l1(grads):
        return [float((g - r).abs().sum() / r.abs().sum()) for g, r in zip(grads, ref)]

    exact, token, block = (rel_l1(_gradients(emulated_attention(m), q, k, v, dout))
                           for m in ("exact", "token", "block"))
    for i in (0, 1):  # dq, dk
        assert 0 < exact[i] < token[i] < block[i] < 0.2
    assert exact[2] == token[2] == block[2] < 1e-5  # dV = P^T dO in float32, the same in every mode
    with pytest.raises(ValueError, match="ds_mode"):
        emulated_attention("tile")
