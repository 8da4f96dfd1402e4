"""Training parity of SageBwd (issue 33): a small GPT trained with torch SDPA in bf16 and with
sagekit's `sagebwd` recipe, same initialization and data order, on text available offline.

    python3 bench/training_parity.py --out parity.json [--plot parity.png]

Data: the Python standard library on this machine, byte-level (256 tokens, no tokenizer).
- "code": the .py sources with their docstrings removed; every 10th file held out;
- "docs": the docstrings of the same files, the fine-tuning split; every 10th file held out.

Runs, each attention with the same seed:
  (a) pretraining from scratch on code for --steps steps;
  (b) fine-tuning the SDPA model of (a) on docs for --finetune-steps steps (both attentions
      start from that one checkpoint).
Validation loss every --eval-every steps (the same held-out batches for every run); at the end
the final losses, their relative gap, tokens per second of the training step and peak memory.
"""

import argparse
import ast
import json
import math

import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- data ----------------------------------------------------------------------------------

def _split_docstrings(source: str) -> Tuple[str, str]:
    """(code without docstrings, the docstrings joined), or the source as code if it does
    not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source, ""
    docs, spans = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docs.append(body[0].value.value)
                spans.append((body[0].lineno, body[0].end_lineno))
    lines = source.splitlines(keepends=True)
    for start, end in sorted(spans, reverse=True):
        del lines[start - 1:end]
    return "".join(lines), "\n\n".join(docs)


def corpus(root: Optional[str] = None, max_files: Optional[int] = None) -> Dict[str, Dict[str, bytes]]:
    """{"code": {"train", "val"}, "docs": {"train", "val"}} as bytes, from the stdlib's .py
    files in sorted order (every 10th file to val)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if max_files:
        files = files[:max_files]
    parts = {s: {"train": [], "val": []} for s in ("code", "docs")}
    for i, path in enumerate(files):
        try:
            code, docs = _split_docstrings(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        split = "val" if i % 10 == 9 else "train"
        parts["code"][split].append(code)
        parts["docs"][split].append(docs)
    return {s: {k: "\n".join(v).encode("utf-8", "replace") for k, v in d.items()} for s, d in parts.items()}


class Batches:
    """Random windows of a byte string, from a seeded generator: the same order for every
    run with the same seed."""

    def __init__(self, data: bytes, context: int, batch: int, seed: int, device):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.context, self.batch, self.device = context, batch, device
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.context - 1, (self.batch,), generator=self.gen)
        rows = torch.stack([self.data[s:s + self.context + 1] for s in starts.tolist()]).long()
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]


# ---- model ---------------------------------------------------------------------------------

@dataclass
class Config:
    layers: int = 6
    heads: int = 8
    head_dim: int = 64
    context: int = 1024
    vocab: int = 256

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


def attention_function(name: str) -> Callable:
    """q, k, v [B, H, N, D] -> causal attention output."""

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    if name == "sdpa":
        return sdpa
    if name not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)} (got {name!r})")
    if name.startswith("emu_"):  # a PyTorch model of the backward's dS quantization
        from sagebwd_emulation import emulated_attention

        return emulated_attention(name[len("emu_"):])
    import sagekit

    def sage(q, k, v, recipe="sagebwd"):
        return sagekit.sageattn(q, k, v, is_causal=True, recipe=recipe)

    if name == "sagebwd":  # dS per token
        return sage
    if name == "sagebwd_block":  # the paper's dS, one scale per 64 x 128 tile
        return lambda q, k, v: sage(q, k, v, recipe="sagebwd_block")
    # Diagnostics that split a gap between the passes: one pass's values, the other's gradients.
    if name == "sagebwd_fwd_only":  # sagebwd's output, SDPA's gradients
        return lambda q, k, v: (lambda ref: ref + (sage(q, k, v) - ref).detach())(sdpa(q, k, v))
    if name == "sagebwd_bwd_only":  # SDPA's output, sagebwd's gradients
        return lambda q, k, v: (lambda out: out + (sdpa(q, k, v) - out).detach())(sage(q, k, v))
    # ... and between the gradients: SDPA's output and gradients but one of dq, dk, dv.
    from_sage = tuple(g == name[len("sagebwd_"):-len("_only")] for g in ("dq", "dk", "dv"))
    return lambda q, k, v: _MixedGradients.apply(q, k, v, sdpa, sage, from_sage)


ATTENTIONS = ("sdpa", "sagebwd", "sagebwd_block", "sagebwd_fwd_only", "sagebwd_bwd_only",
              "sagebwd_dq_only", "sagebwd_dk_only", "sagebwd_dv_only", "emu_block", "emu_token",
              "emu_exact")


class _MixedGradients(torch.autograd.Function):
    """`reference`'s output; each of dq, dk, dv from `other` where from_other says so, else
    from `reference`."""

    @staticmethod
    def forward(ctx, q, k, v, reference, other, from_other):
        ctx.save_for_backward(q, k, v)
        ctx.functions, ctx.from_other = (reference, other), from_other
        return reference(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            ref, other = (torch.autograd.grad(f(*inputs), inputs, grad) for f in ctx.functions)
        return tuple(o if use else r for r, o, use in zip(ref, other, ctx.from_other)) + (None,) * 3


class Block(nn.Module):
    def __init__(self, cfg: Config, attend: Callable):
        super().__init__()
        self.cfg, self.attend = cfg, attend
        self.norm1, self.norm2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(),
                                 nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.cfg.heads, self.cfg.head_dim).unbind(2)
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, attend: Callable):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.width))
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# ---- training ------------------------------------------------------------------------------

@dataclass
class Schedule:
    steps: int
    lr: float = 1e-3
    warmup: int = 50
    batch: int = 16
    eval_every: int = 50
    eval_batches: int = 8

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(model, val: bytes, cfg: Config, sched: Schedule, device) -> float:
    batches = Batches(val, cfg.context, sched.batch, seed=1234, device=device)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        losses = [float(model(*batches.next())) for _ in range(sched.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def train(model, data: Dict[str, bytes], cfg: Config, sched: Schedule, device, seed: int,
          log: Callable[[str], None]) -> Dict:
    opt = torch.optim.AdamW(model.parameters(), lr=sched.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = Batches(data["train"], cfg.context, sched.batch, seed=seed, device=device)
    curve, train_losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed_tokens, timed_seconds = 0, 0.0
    for step in range(sched.steps):
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(step)
        tokens, targets = batches.next()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= 10:   # the first steps compile and warm up
            timed_seconds += time.perf_counter() - start
            timed_tokens += tokens.numel()
        train_losses.append(float(loss.detach()))
        if not math.isfinite(train_losses[-1]):
            raise FloatingPointError(f"training loss is {train_losses[-1]} at step {step}")
        if (step + 1) % sched.eval_every == 0 or step + 1 == sched.steps:
            val = evaluate(model, data["val"], cfg, sched, device)
            curve.append((step + 1, val))
            log(f"  step {step + 1:5d}  train {train_losses[-1]:.4f}  val {val:.4f}")
    return dict(val_curve=curve, train_losses=train_losses, final_val=curve[-1][1],
                tokens_per_s=timed_tokens / timed_seconds if timed_seconds else None,
                peak_memory_gib=(torch.cuda.max_memory_allocated(device) / 2**30
                                 if device.type == "cuda" else None))


def build(cfg: Config, attend: Callable, device, seed: int, state=None):
    torch.manual_seed(seed)
    model = GPT(cfg, attend).to(device)
    if state is not None:
        model.load_state_dict(state)
    return model


def run_parity(cfg: Config, pre: Schedule, fine: Schedule, attentions: Dict[str, Callable],
               device, data, seed: int = 0, log=print) -> Dict:
    """attentions: name -> attention function, the first the baseline whose pretrained
    model every fine-tuning run starts from."""
    result = dict(config=asdict(cfg), pretrain=asdict(pre), finetune=asdict(fine), runs={})
    names = list(attentions)
    checkpoint = None
    for attention in names:
        log(f"pretraining on code with {attention}")
        model = build(cfg, attentions[attention], device, seed)
        result["runs"][f"pretrain_{attention}"] = train(model, data["code"], cfg, pre, device, seed, log)
        if attention == names[0]:
            checkpoint = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
    for attention in names:
        log(f"fine-tuning the {names[0]} checkpoint on docs with {attention}")
        model = build(cfg, attentions[attention], device, seed, state=checkpoint)
        result["runs"][f"finetune_{attention}"] = train(model, data["docs"], cfg, fine, device, seed + 1, log)
        del model
    base, other = names[0], names[-1]
    for phase in ("pretrain", "finetune"):
        a, b = result["runs"][f"{phase}_{base}"]["final_val"], result["runs"][f"{phase}_{other}"]["final_val"]
        result[f"{phase}_gap"] = (b - a) / a
    return result


def plot(result: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("pretrain", "finetune")):
        for name, run in result["runs"].items():
            if name.startswith(phase):
                steps, vals = zip(*run["val_curve"])
                ax.plot(steps, vals, marker=".", label=name.split("_", 1)[1])
        ax.set_title(f"{phase}: final gap {100 * result[f'{phase}_gap']:+.2f}%")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats / byte)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    p.add_argument("--attentions", default="sdpa,sagebwd",
                   help="the first is the baseline; of " + ", ".join(ATTENTIONS) + " (the _only "
                   "ones take one pass from sagebwd and the other from SDPA: diagnostics)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--finetune-steps", type=int, default=500)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-files", type=int, help="fewer stdlib files (quick runs)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = Config(args.layers, args.heads, args.head_dim, args.context)
    pre = Schedule(args.steps, batch=args.batch, eval_every=args.eval_every)
    fine = Schedule(args.finetune_steps, lr=3e-4, warmup=20, batch=args.batch, eval_every=args.eval_every)
    data = corpus(max_files=args.max_files)
    print({s: {k: len(v) for k, v in d.items()} for s, d in data.items()}, "bytes", flush=True)
    names = args.attentions.split(",")
    if len(set(names)) != len(names):
        p.error(f"--attentions: each attention once (got {args.attentions})")
    result = run_parity(cfg, pre, fine, {n: attention_function(n) for n in names}, device, data,
                        log=lambda s: print(s, flush=True))
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"pretrain gap {100 * result['pretrain_gap']:+.3f}%  finetune gap "
          f"{100 * result['finetune_gap']:+.3f}%")
    for name, run in result["runs"].items():
        print(f"{name:20s} final val {run['final_val']:.4f}  tokens/s {run['tokens_per_s'] or 0:,.0f}"
              f"  peak {run['peak_memory_gib'] or 0:.2f} GiB")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
