#!/usr/bin/env python3
"""Plug sagekit into an unmodified model and compare it with torch SDPA.

The model comes from an installed library with random weights (nothing is downloaded):
  --model vit     timm's vit_base_patch16_224 built for larger images (more tokens)
  --model llama   a transformers LLaMA (GQA) with a random-initialised config

For every sequence length the model runs once with torch's scaled_dot_product_attention and
once inside `sagekit.patch_sdpa()`, which routes every F.scaled_dot_product_attention call
to sagekit. Reported: cosine similarity and relative L1 of the model outputs, the median
end-to-end forward time of each and the speedup; a table on stdout and a JSON file.

    python examples/plug_and_play.py --json out/plug_and_play.json
    python examples/plug_and_play.py --model llama --seq 2048 8192 --json llama.json
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
from typing import Callable, Dict, List

import torch

import sagekit

try:
    from tqdm import tqdm
except ImportError:  # the bar is a convenience; the script works without it
    tqdm = None


def build_vit(tokens: int, dtype: torch.dtype, batch: int):
    import timm

    side = max(1, round(math.sqrt(tokens)))
    img = side * 16
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=img)
    # timm reads TIMM_FUSED_ATTN once; make sure every block calls F.scaled_dot_product_attention.
    for block in model.blocks:
        block.attn.fused_attn = True
    model = model.to("cuda", dtype).eval()
    x = torch.randn(batch, 3, img, img, device="cuda", dtype=dtype)
    seq = side * side + getattr(model, "num_prefix_tokens", 1)
    return model, (lambda: model(x)), seq


def build_llama(tokens: int, dtype: torch.dtype, batch: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                         max_position_embeddings=max(4096, tokens), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    ids = torch.randint(0, config.vocab_size, (batch, tokens), device="cuda")
    return model, (lambda: model(input_ids=ids, use_cache=False).logits), tokens


BUILDERS = {"vit": build_vit, "llama": build_llama}
DEFAULT_SEQ = {"vit": [1024, 4096, 9216, 16384], "llama": [1024, 4096, 8192, 16384]}


def time_ms(fn: Callable[[], torch.Tensor], warmup: int, iters: int) -> float:
    """Median forward time in milliseconds, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare(a: torch.Tensor, b: torch.Tensor) -> Dict[str, float]:
    a, b = a.double().flatten(), b.double().flatten()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    l1 = ((a - b).abs().sum() / b.abs().sum().clamp_min(1e-300)).item()
    return {"cosine": cos, "rel_l1": l1}


def run(args) -> Dict:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    build = BUILDERS[args.model]
    seqs = args.seq or DEFAULT_SEQ[args.model]
    rows: List[Dict] = []
    bar = tqdm(total=len(seqs) * 2, desc=f"{args.model} ({args.dtype})", unit="run") if tqdm else None
    for tokens in seqs:
        model, forward, seq = build(tokens, dtype, args.batch)
        with torch.inference_mode():
            if bar:
                bar.set_postfix_str(f"seq {seq}: torch SDPA")
            reference = forward().float()
            torch_ms = time_ms(forward, args.warmup, args.iters)
            if bar:
                bar.update(1)
                bar.set_postfix_str(f"seq {seq}: sagekit")
            with sagekit.patch_sdpa(recipe=args.recipe) as stats:
                ours = forward().float()
                sage_ms = time_ms(forward, args.warmup, args.iters)
            if bar:
                bar.update(1)
        if stats.calls == 0:
            raise RuntimeError(f"{args.model} never called F.scaled_dot_product_attention; "
                               "nothing was replaced")
        row = {"seq_len": seq, "batch": args.batch, "torch_ms": torch_ms, "sagekit_ms": sage_ms,
               "speedup": torch_ms / sage_ms, **compare(ours, reference),
               "sdpa_calls_replaced": stats.calls // (1 + args.warmup + args.iters)}
        rows.append(row)
        del model, forward, reference, ours
        torch.cuda.empty_cache()
    if bar:
        bar.close()
    return {
        "model": args.model, "dtype": args.dtype, "recipe": args.recipe,
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "sagekit": sagekit.__version__, "python": platform.python_version(),
        "warmup": args.warmup, "iters": args.iters, "results": rows,
    }


def table(report: Dict) -> str:
    head = ["seq_len", "batch", "torch SDPA ms", "sagekit ms", "speedup", "cosine", "rel L1"]
    lines = [f"{report['model']} {report['dtype']} recipe={report['recipe']} on {report['device']}",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in report["results"]:
        lines.append(f"| {r['seq_len']} | {r['batch']} | {r['torch_ms']:.2f} | {r['sagekit_ms']:.2f} "
                     f"| {r['speedup']:.2f}x | {r['cosine']:.5f} | {r['rel_l1']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(BUILDERS), default="vit")
    p.add_argument("--seq", type=int, nargs="+",
                   help="sequence lengths (tokens; ViT rounds to a square grid of 16x16 patches)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--recipe", default="auto", help="sagekit recipe (preset name or spec string)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", required=True, help="where to write the results as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("plug_and_play needs a CUDA GPU (sagekit's kernels run on compute capability 9.0)",
              file=sys.stderr)
        return 2
    report = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(table(report))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
