"""A PyTorch model of SageBwd's backward quantization, for design studies on a GPU before a
kernel exists (bench/training_parity.py's `emu_*` attentions).

The forward is torch SDPA's (exact up to its 16-bit output): the parity study measured that
sagebwd's forward alone leaves training unchanged (docs/performance.md, "Training parity").
The backward is FlashAttention's in float32 with dQ = dS K' and dK = dS^T Q taking fake-quantized
INT8 operands as the sm_90 kernel's tiles do (docs/numerics.md, backward steps 7-8):
  - Q per 64-row tile, K' = K - mean(K) per 128-key tile, one symmetric scale each;
  - dS per 64 x 128 tile (ds="block", the paper's and sagebwd_block's), or per token of the
    tile (ds="token", sagebwd's: a scale per query row for dQ and per key for dK, so dS is
    quantized twice),
    or left in float32 (ds="exact": only Q and K' quantized).
dP = dO V^T and dV = P^T dO stay float32 (dV's INT8 P did not move the loss in the study).
Materializes [B, H, N, N] matrices: for the study's short contexts only.
"""

from typing import Tuple

import torch
import torch.nn.functional as F

Q_TILE, K_TILE = 64, 128
DS_MODES = ("block", "token", "exact")


def _fake_int8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x rounded to the INT8 grid of scale amax / 127 (amax broadcast against x)."""
    scale = amax / 127
    codes = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale)))
    return codes.clamp(-127, 127) * scale


def _rows_per_tile(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [B, H, N, D] fake-quantized with one scale per `rows` consecutive rows."""
    b, h, n, d = x.shape
    pad = (-n) % rows
    t = F.pad(x, (0, 0, 0, pad)).view(b, h, (n + pad) // rows, rows, d)
    out = _fake_int8(t, t.abs().amax(dim=(3, 4), keepdim=True))
    return out.view(b, h, n + pad, d)[:, :, :n]


def _ds_tiles(ds: torch.Tensor, mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """dS [B, H, Nq, Nk] as dQ's and dK's INT8 operands see it (dequantized)."""
    if mode == "exact":
        return ds, ds
    b, h, nq, nk = ds.shape
    pq, pk = (-nq) % Q_TILE, (-nk) % K_TILE
    t = F.pad(ds, (0, pk, 0, pq)).view(b, h, (nq + pq) // Q_TILE, Q_TILE, (nk + pk) // K_TILE, K_TILE)

    def back(x):
        return x.view(b, h, nq + pq, nk + pk)[:, :, :nq, :nk]

    if mode == "block":
        same = back(_fake_int8(t, t.abs().amax(dim=(3, 5), keepdim=True)))
        return same, same
    per_row = back(_fake_int8(t, t.abs().amax(dim=5, keepdim=True)))   # dQ: a scale per query
    per_key = back(_fake_int8(t, t.abs().amax(dim=3, keepdim=True)))   # dK: a scale per key
    return per_row, per_key


class EmulatedSageBwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ds_mode: str):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out)
        ctx.ds_mode = ds_mode
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = (t.float() for t in ctx.saved_tensors)
        do = dout.float()
        scale = q.shape[-1] ** -0.5
        n_q, n_k = q.shape[2], k.shape[2]
        s = (q @ k.transpose(-1, -2)) * scale
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        del s
        dv = p.transpose(-1, -2) @ do
        d = (do * out).sum(-1, keepdim=True)
        ds = p * ((do @ v.transpose(-1, -2)) - d)
        del p
        ds_q, ds_k = _ds_tiles(ds, ctx.ds_mode)
        del ds
        k_smoothed = k - k.mean(dim=2, keepdim=True)
        dq = (ds_q @ _rows_per_tile(k_smoothed, K_TILE)) * scale
        dk = (ds_k.transpose(-1, -2) @ _rows_per_tile(q, Q_TILE)) * scale
        dtype = ctx.saved_tensors[0].dtype
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None


def emulated_attention(ds_mode: str):
    if ds_mode not in DS_MODES:
        raise ValueError(f"ds_mode must be one of {', '.join(DS_MODES)} (got {ds_mode!r})")
    return lambda q, k, v: EmulatedSageBwd.apply(q, k, v, ds_mode)
