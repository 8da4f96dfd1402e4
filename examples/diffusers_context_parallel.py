"""A diffusers video transformer on several GPUs with sagekit as its attention (issue 37).

    torchrun --nproc-per-node 2 examples/diffusers_context_parallel.py [--out result.json]

Builds Wan 2.1's transformer (WanTransformer3DModel with the T2V-1.3B configuration: 12 heads
of 128, hidden 1536) from its config with random weights and reduced depth (no download),
and runs one denoising step of an 81-frame 480x832 video's latents (21 x 60 x 104 latents,
32,760 tokens) with 512 text tokens:

1. on each GPU alone with torch SDPA (diffusers' "native" backend): the reference output;
2. on each GPU alone with sagekit (`set_attention_backend("sagekit")`);
3. split over all GPUs with diffusers' context parallelism, Ulysses and then ring, sagekit
   as the attention kernel (`sagekit.distributed.register_diffusers_backend`).

Prints each output's difference from the SDPA reference (relative L1 and cosine) and each
forward's time (median of CUDA-event timings; the slowest rank's for the parallel runs).
Cross-attention runs unsplit on every rank (the model's own choice in diffusers 0.42.1).
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

import sagekit.distributed

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                rope_max_seq_len=1024)


def build_model(layers: int, device, dtype):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)   # the same weights on every rank
    config = dict(WAN_1_3B, num_layers=layers)
    return WanTransformer3DModel(**config).to(device=device, dtype=dtype).eval()


def make_inputs(args, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(1, 16, args.frames, args.height, args.width, generator=g)
    text = torch.randn(1, 512, WAN_1_3B["text_dim"], generator=g)
    tokens = args.frames * (args.height // 2) * (args.width // 2)
    # The timestep per token (Wan 2.2's form, the same value everywhere, so Wan 2.1's result):
    # diffusers 0.42.1's context-parallel plan splits a [B, tokens] timestep and fails on a
    # [B] one (its warning for an unsplit input calls a logger method that does not exist).
    timestep = torch.full((1, tokens), 500, device=device)
    return dict(hidden_states=latents.to(device, dtype), timestep=timestep,
                encoder_hidden_states=text.to(device, dtype), return_dict=False)


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def timed(fn, warmup: int, iters: int, parallel: bool):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if parallel:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda")
        if parallel:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return out, statistics.median(times)


def difference(out, ref):
    out, ref = out.double().flatten(), ref.double().flatten()
    return dict(rel_l1=float((out - ref).abs().sum() / ref.abs().sum()),
                cosine=float(torch.nn.functional.cosine_similarity(out, ref, dim=0)),
                nan=bool(torch.isnan(out).any()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (the model has 30)")
    p.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames)")
    p.add_argument("--height", type=int, default=60, help="latent height (480 pixels)")
    p.add_argument("--width", type=int, default=104, help="latent width (832 pixels)")
    p.add_argument("--recipe", default="auto", help="sagekit recipe")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", help="JSON result, written by rank 0")
    args = p.parse_args(argv)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dtype = torch.bfloat16
    from diffusers import ContextParallelConfig

    sagekit.distributed.register_diffusers_backend("sagekit", recipe=args.recipe)
    inputs = make_inputs(args, device, dtype)
    tokens = args.frames * (args.height // 2) * (args.width // 2)

    model = build_model(args.layers, device, dtype)
    reference, ms_sdpa = timed(lambda: forward(model, inputs), 1, args.iters, parallel=False)
    model.set_attention_backend("sagekit")
    single, ms_single = timed(lambda: forward(model, inputs), 1, args.iters, parallel=False)
    runs = {"single_gpu_sdpa": dict(ms=ms_sdpa, ranks=1),
            "single_gpu_sagekit": dict(ms=ms_single, ranks=1, **difference(single, reference))}
    del single
    for name, config in (("ulysses", ContextParallelConfig(ulysses_degree=world)),
                         ("ring", ContextParallelConfig(ring_degree=world))):
        model = build_model(args.layers, device, dtype)
        model.set_attention_backend("sagekit")
        model.enable_parallelism(config=config)
        out, ms = timed(lambda: forward(model, inputs), 1, args.iters, parallel=True)
        runs[f"{name}_sagekit"] = dict(ms=ms, ranks=world, **difference(out, reference))
        del out
        torch.cuda.empty_cache()

    if rank == 0:
        print(f"Wan 2.1 T2V-1.3B transformer, {args.layers} of 30 blocks, random weights, bf16; "
              f"{tokens} video tokens, 512 text tokens; {world} x {torch.cuda.get_device_name(device)}")
        print(f"{'run':22s} {'GPUs':>4s} {'ms':>9s} {'speedup':>8s} {'rel L1 vs SDPA':>15s} {'cosine':>9s}")
        for name, r in runs.items():
            diff = (f"{r['rel_l1']:15.4e} {r['cosine']:9.6f}" if "rel_l1" in r else f"{'(reference)':>15s}")
            print(f"{name:22s} {r['ranks']:4d} {r['ms']:9.2f} {ms_sdpa / r['ms']:7.2f}x {diff}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(model="Wan2.1-T2V-1.3B config", layers=args.layers, tokens=tokens,
                               text_tokens=512, dtype="bfloat16", gpus=world,
                               device=torch.cuda.get_device_name(device), recipe=args.recipe,
                               runs=runs), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    bad = [n for n, r in runs.items() if r.get("nan")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
