"""Speed of every recipe: `bench_sdpa.py --recipes all|NAME,..` (this module does the work).

sagekit alone, whole call (K/V pre-pass + attention kernel, as a user calls it), one record
per (preset, grid point) with impl "sagekit" and the preset's name as recipe, in the same
record format and protocol as bench_sdpa.py (median of CUDA-event timings after warm-up, two
input sets alternated, 32K tokens per call, TOPS = 4 B H N^2 d / time, halved for causal).
torch SDPA is not timed here: bench_sdpa.py's default mode times it side by side with sage2_8b.

Prequantized presets (int_flash) are timed on INT8 inputs made beforehand on the GPU (Q and K
per token, V per tensor or per channel as the preset says, amax / 127, round half to even: the
rule of sage::reference::prequantize_int8), since that is what such a caller passes; their
output dtype is the grid's dtype. A preset the GPU path refuses (sage3_fp4: FP4 needs
Blackwell) gets a record with status "unsupported" and the error's message instead of ms/tops,
as `sage bench --json` writes it, so `sage docs` can say "refused" rather than "not measured";
any other error gives status "failed".

Each record also carries the accuracy of that call on one head of the same inputs against
float64 attention of the fp16 inputs (cosine, rel_l1), as bench_sdpa.py records for sage2_8b.
"""
import json
import sys
import time

import torch
import torch.nn.functional as F


def prequantize_int8(q, k, v, v_per_channel):
    """INT8 codes and f32 scales as Inputs::prequantized_int8 takes them ([B, H, N, D] input)."""
    def per_token(x):
        amax = x.float().abs().amax(dim=-1)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        codes = torch.round(x.float() * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        return codes, (amax / 127.0).contiguous()

    q8, qs = per_token(q)
    k8, ks = per_token(k)
    amax = v.float().abs().amax(dim=2)  # [B, H, D]: per channel over tokens
    if not v_per_channel:
        amax = amax.amax(dim=-1)  # [B, H]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    inv_b = inv[:, :, None, :] if v_per_channel else inv[:, :, None, None]
    v8 = torch.round(v.float() * inv_b).clamp_(-127, 127).to(torch.int8)
    return q8, k8, v8, qs, ks, (amax / 127.0).contiguous()


def run_recipes(args, median_ms):
    """Times every preset named by args.recipes on the grid of args (dims, ns, causal, dtypes)."""
    import sagekit

    presets = {p["name"]: p for p in sagekit.presets()}
    names = list(presets) if args.recipes == "all" else [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in presets]
    if unknown or not names:
        sys.exit(f"bench_sdpa.py: --recipes: unknown preset(s) {', '.join(unknown) or '(none given)'}; "
                 f"allowed: all, {', '.join(presets)}")
    dev = torch.cuda.get_device_name()
    grid = [(dt, d, c, n) for dt in args.dtypes.split(",") for d in map(int, args.dims.split(","))
            for c in map(int, args.causal.split(",")) for n in map(int, args.ns.split(","))]
    records = []
    t_start = time.time()
    for idx, (dt, d, causal, n) in enumerate(grid):
        dtype = getattr(torch, dt)
        batch = max(1, args.tokens // n)
        sets = [[torch.randn(batch, args.heads, n, d, device="cuda", dtype=dtype) for _ in range(3)]
                for _ in range(2)]
        ops = 4.0 * batch * args.heads * n * n * d / (2 if causal else 1)
        q1, k1, v1 = (t[:1, :1] for t in sets[0])
        ref = F.scaled_dot_product_attention(q1.double(), k1.double(), v1.double(), is_causal=bool(causal))
        line = []
        for name in names:
            p = presets[name]
            rec = dict(impl="sagekit", recipe=name, d=d, causal=bool(causal), n=n, batch=batch,
                       heads=args.heads, dtype=dt, whole_call=True)
            inputs = None
            try:
                if p.get("inputs") == "prequantized_int8":
                    per_channel = p.get("v_scale") == "per_channel"
                    inputs = [prequantize_int8(*s, per_channel) for s in sets]

                    def call(i=0, name=name, inputs=inputs):
                        q8, k8, v8, qs, ks, vs = inputs[i % 2]
                        return sagekit.sageattn(q8, k8, v8, is_causal=bool(causal), recipe=name,
                                                q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=dtype)

                    def one_head(name=name, inputs=inputs):
                        q8, k8, v8, qs, ks, vs = (t[:1, :1] for t in inputs[0])
                        return sagekit.sageattn(q8, k8, v8, is_causal=bool(causal), recipe=name,
                                                q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=dtype)
                else:
                    def call(i=0, name=name):
                        return sagekit.sageattn(*sets[i % 2], is_causal=bool(causal), recipe=name)

                    def one_head(name=name):
                        return sagekit.sageattn(q1, k1, v1, is_causal=bool(causal), recipe=name)
                ms = median_ms(call, args.warmup, args.iters)
            except Exception as e:
                # A preset the GPU path refuses (an ArgumentError naming "recipe") is recorded as
                # such, not left out; anything else is a failure, recorded as one (sage docs
                # shows it as "not measured"), never as a refusal.
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                refused = getattr(e, "argument", None) == "recipe"
                rec.update(device=dev, status="unsupported" if refused else "failed", message=msg)
                records.append(rec)
                line.append(f"{name} {'refused' if refused else 'FAILED'}")
                print(f"  {name}: {msg}", file=sys.stderr)
                del inputs
                continue
            tops = ops / (ms * 1e-3) / 1e12
            out = one_head().double()
            rec.update(ms=ms, tops=tops, device=dev,
                       cosine=F.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item(),
                       rel_l1=((out - ref).abs().sum() / ref.abs().sum()).item())
            records.append(rec)
            line.append(f"{name} {tops:.0f}")
            del inputs
        del sets
        torch.cuda.empty_cache()
        print(f"[{idx + 1}/{len(grid)}] {dt} d={d} causal={causal} n={n}: " + "  ".join(line)
              + f"  ({time.time() - t_start:.0f}s)", flush=True)

    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    # Markdown: one row per preset, one column per grid point.
    points = [(dt, d, c, n) for dt, d, c, n in grid]
    head = [f"{dt} d{d}{' causal' if c else ''} N{f'{n // 1024}K' if n % 1024 == 0 else n}"
            for dt, d, c, n in points]
    lines = [f"sagekit whole-call TOPS per recipe on {dev} (median of {args.iters} CUDA-event timings).", "",
             "| recipe | " + " | ".join(head) + " |", "|---|" + "---|" * len(points)]
    keyed = {(r["recipe"], r["dtype"], r["d"], r["causal"], r["n"]): r for r in records}
    for name in names:
        cells = []
        for dt, d, c, n in points:
            r = keyed.get((name, dt, d, bool(c), n))
            cells.append("not measured" if r is None else f"{r['tops']:.0f}" if "tops" in r
                         else "refused" if r["status"] == "unsupported" else "failed")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
