"""Sequence-parallel attention through yunchang and diffusers, with sagekit as the kernel.

One process per GPU, under torchrun:

    torchrun --nproc-per-node 2 bench/sequence_parallel.py check --out sp_check.json
    torchrun --nproc-per-node 2 bench/sequence_parallel.py bench --out sp_bench.json

check: every engine mode this world size allows (yunchang Ulysses, ring "basic", ring
"zigzag", USP; diffusers Ulysses, ring, unified), head dims 64 and 128, causal and not
(diffusers' templates take no causal mask), GQA (yunchang; diffusers' templates take none).
Each case shards one sequence as the engine expects, runs the engine, gathers the output,
and measures its relative L1 error against float64 next to the single-GPU sagekit call's.
Writes one record per case; tests/python/test_distributed_gpu.py runs this and asserts.

bench: forward throughput of one long sequence (24 heads, d 128, non-causal, the video-DiT
shape) on one GPU (a plain call) and through each engine on all GPUs, for sagekit and for
torch SDPA's cuDNN and flash kernels plugged into the same engine. Whole engine call
(all-to-alls and ring steps included), the slowest rank's time, median over iterations.

--device cpu runs the same code with gloo and a float32 reference kernel standing in for
sagekit: a check of the plumbing (sharding, engine calls, gathering) only, never a result.
Engine versions: docs/distributed.md. Records: bench/results/*sequence_parallel*.json.
"""

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import sagekit
import sagekit.distributed as skd


@dataclass(frozen=True)
class Mode:
    engine: str        # "yunchang" or "diffusers"
    name: str          # "ulysses", "ring", "zigzag" or "usp"
    ulysses: int
    ring: int
    ring_impl: str = "basic"   # yunchang's ring_impl_type (and its sharding)


def modes_for(world: int, causal: bool) -> List[Mode]:
    modes = [Mode("yunchang", "ulysses", world, 1), Mode("yunchang", "ring", 1, world)]
    if causal:
        modes.append(Mode("yunchang", "zigzag", 1, world, "zigzag"))
    if world >= 4 and world % 2 == 0:
        modes.append(Mode("yunchang", "usp", 2, world // 2, "zigzag" if causal else "basic"))
    if not causal:
        modes += [Mode("diffusers", "ulysses", world, 1), Mode("diffusers", "ring", 1, world)]
        if world >= 4 and world % 2 == 0:
            modes.append(Mode("diffusers", "usp", 2, world // 2))
    return modes


# ---- the world -----------------------------------------------------------------------------

class World:
    def __init__(self, device_kind: str):
        self.cpu = device_kind == "cpu"
        dist.init_process_group("gloo" if self.cpu else "nccl")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        if self.cpu:
            self.device = torch.device("cpu")
        else:
            local = int(os.environ.get("LOCAL_RANK", self.rank))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)

    def say(self, *args) -> None:
        if self.rank == 0:
            print(*args, flush=True)

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()
        dist.barrier()


def install_cpu_reference_kernel() -> None:
    """--device cpu: sagekit.sageattn replaced by float32 attention with its signature."""
    import sagekit.attention

    def reference(q, k, v, is_causal=False, scale=None, layout="HND", recipe="auto",
                  return_lse=False, *, window_size=(-1, -1), **unused):
        if layout == "NHD":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        out, lse = reference_attention(q.float(), k.float(), v.float(), is_causal, scale)
        out = out.to(q.dtype)
        if layout == "NHD":
            out = out.transpose(1, 2)
        return (out, lse.float()) if return_lse else out

    sagekit.attention.sageattn = reference
    sagekit.sageattn = reference


def reference_attention(q, k, v, causal: bool, scale: Optional[float]):
    """Softmax attention in q's dtype, HND, GQA by repetition, causal bottom-right: out, lse."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        rows = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        s = s.masked_fill(torch.arange(nk, device=q.device)[None, :] > rows, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), v), lse


# ---- kernels for the engines: sagekit, or torch SDPA for the side-by-side runs ---------------

def sdpa_kernel(backend: str) -> Callable:
    """torch SDPA's cuDNN or flash kernel with yunchang's fwd-only signature and a float32
    [B, H, S] LSE (yunchang's own TORCH_CUDNN returns zeros there, which no ring can merge)."""
    def kernel(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
               softcap=None, alibi_slopes=None, return_softmax=False, **unused):
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        if backend == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qh, kh, vh, None, True, 0.0, causal, False, scale=softmax_scale)
        else:
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qh, kh, vh, 0.0, causal, False, scale=softmax_scale)
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2]).float()
    return kernel


class SdpaAttnType:
    """The attn_type for an SDPA kernel in yunchang (not an AttnType: selection falls through
    to attn_processor, as for sagekit)."""
    def __init__(self, backend: str):
        self.kernel = sdpa_kernel(backend)


# ---- yunchang ------------------------------------------------------------------------------

def yunchang_runner(world: World, mode: Mode, kernel: str, recipe) -> Callable:
    from yunchang import LongContextAttention, set_seq_parallel_pg

    set_seq_parallel_pg(mode.ulysses, mode.ring, world.rank, world.size)
    if kernel == "sagekit":
        layer = skd.yunchang_long_context_attention(ring_impl_type=mode.ring_impl, recipe=recipe)
    else:
        if mode.ring_impl != "basic":
            raise ValueError("the SDPA side-by-side runs use the basic ring")
        attn_type = SdpaAttnType(kernel)
        layer = LongContextAttention(ring_impl_type="basic", attn_type=attn_type,
                                     attn_processor=attn_type.kernel)

    def run(q, k, v, causal: bool):
        with torch.no_grad():
            return layer(q, k, v, causal=causal)
    return run


def yunchang_shard(world: World, mode: Mode, x: torch.Tensor) -> torch.Tensor:
    """The rank's part of a [B, S, ...] tensor, as yunchang's own extract functions lay it out."""
    from yunchang.comm.extract_local import EXTRACT_FUNC_DICT

    extract = EXTRACT_FUNC_DICT[mode.ring_impl]
    return extract(x, world.rank, world.size, rd=mode.ring, ud=mode.ulysses).contiguous()


# ---- diffusers -----------------------------------------------------------------------------

_DIFFUSERS_BACKENDS = {"sagekit": "sagekit", "cudnn": "_native_cudnn", "flash": "_native_flash"}


def diffusers_parallel_config(world: World, mode: Mode):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world.device.type, (mode.ring, mode.ulysses),
                            mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(
        ring_degree=mode.ring, ulysses_degree=mode.ulysses))
    config.setup(world.rank, world.size, world.device, mesh=mesh)
    return config


def diffusers_runner(world: World, mode: Mode, kernel: str, recipe) -> Callable:
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if kernel == "sagekit":
        skd.register_diffusers_backend("sagekit", recipe=recipe)
    backend = _DIFFUSERS_BACKENDS[kernel]
    config = diffusers_parallel_config(world, mode)

    def run(q, k, v, causal: bool):
        if causal:
            raise ValueError("diffusers' context-parallel templates take no causal mask")
        with torch.no_grad():
            return dispatch_attention_fn(q, k, v, backend=backend, parallel_config=config)
    return run


def contiguous_shard(world: World, x: torch.Tensor) -> torch.Tensor:
    return x.chunk(world.size, dim=1)[world.rank].contiguous()


# ---- one engine call on one sequence -------------------------------------------------------

def shard(world: World, mode: Mode, x: torch.Tensor) -> torch.Tensor:
    return yunchang_shard(world, mode, x) if mode.engine == "yunchang" else contiguous_shard(world, x)


def runner(world: World, mode: Mode, kernel: str, recipe) -> Callable:
    make = yunchang_runner if mode.engine == "yunchang" else diffusers_runner
    return make(world, mode, kernel, recipe)


def gather_sequence(world: World, mode: Mode, local: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Every rank's output put back in sequence order: [B, S, H, D]. The positions each rank
    holds come from sharding a tensor of positions the same way as the inputs."""
    positions = shard(world, mode, torch.arange(seq_len, device=local.device)[None, :])[0]
    parts = [torch.empty_like(local) for _ in range(world.size)]
    dist.all_gather(parts, local.contiguous())
    where = [torch.empty_like(positions) for _ in range(world.size)]
    dist.all_gather(where, positions)
    full = torch.empty(local.shape[0], seq_len, *local.shape[2:], dtype=local.dtype,
                       device=local.device)
    for part, pos in zip(parts, where):
        full[:, pos] = part
    return full


# ---- check ---------------------------------------------------------------------------------

def make_inputs(n: int, heads_q: int, heads_kv: int, d: int, dtype, device, seed: int):
    """q, k, v [1, N, H, D] (NHD), the same on every rank: N(0, 1), K with a per-channel
    offset (what K smoothing is for, and what makes each ring chunk's K mean its own)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, n, heads_q, d, generator=g)
    k = torch.randn(1, n, heads_kv, d, generator=g) + 2.0 * torch.randn(1, 1, heads_kv, d, generator=g)
    v = torch.randn(1, n, heads_kv, d, generator=g)
    return tuple(x.to(dtype).to(device) for x in (q, k, v))


def rel_l1(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().sum() / ref.abs().sum())


def float64_reference(q, k, v, causal: bool):
    """out [B, S, H, D] float64 and lse [B, H, S], one query head at a time (memory)."""
    qh, kh, vh = (x.transpose(1, 2).double() for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    outs, lses = [], []
    for h in range(qh.shape[1]):
        o, l = reference_attention(qh[:, h:h + 1], kh[:, h // group:h // group + 1],
                                   vh[:, h // group:h // group + 1], causal, None)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=1).transpose(1, 2), torch.cat(lses, dim=1)


def check(world: World, args) -> List[Dict]:
    records = []
    dtype = torch.float16
    for d in (64, 128):
        for causal in (False, True):
            for heads_q, heads_kv in ((8, 8), (16, 4)):
                if heads_kv % world.size:
                    continue   # Ulysses splits the K/V heads over its ranks
                q, k, v = make_inputs(args.check_n, heads_q, heads_kv, d, dtype, world.device,
                                      seed=d + 2 * causal + heads_kv)
                ref, ref_lse = float64_reference(q, k, v, causal)
                single, single_lse = sagekit.sageattn(q, k, v, is_causal=causal, layout="NHD",
                                                      recipe=args.recipe, return_lse=True)
                single_err = rel_l1(single, ref)
                lse_err = float((single_lse.double() - ref_lse).abs().max())
                for mode in modes_for(world.size, causal):
                    if mode.engine == "diffusers" and heads_q != heads_kv:
                        continue   # diffusers' templates take no GQA
                    run = runner(world, mode, "sagekit", args.recipe)
                    local = run(*(shard(world, mode, x) for x in (q, k, v)), causal=causal)
                    out = gather_sequence(world, mode, local, args.check_n)
                    err = rel_l1(out, ref)
                    rec = dict(engine=mode.engine, mode=mode.name, ulysses=mode.ulysses,
                               ring=mode.ring, ring_impl=mode.ring_impl, ranks=world.size,
                               d=d, causal=causal, heads_q=heads_q, heads_kv=heads_kv,
                               n=args.check_n, dtype="float16", recipe=str(args.recipe),
                               rel_l1=err, single_rel_l1=single_err,
                               ratio=err / single_err if single_err > 0 else float("inf"),
                               nan=bool(torch.isnan(out).any()),
                               single_lse_max_abs_err=lse_err,
                               kernel="sagekit" if not world.cpu else "cpu-reference")
                    records.append(rec)
                    world.say(f"{mode.engine:9s} {mode.name:7s} U{mode.ulysses} R{mode.ring} "
                              f"d{d} causal={int(causal)} H{heads_q}/{heads_kv}: rel L1 "
                              f"{err:.4e} single {single_err:.4e} ratio {rec['ratio']:.3f} "
                              f"nan={rec['nan']} lse err {lse_err:.2e}")
    return records


# ---- bench ---------------------------------------------------------------------------------

def time_call(world: World, fn: Callable, warmup: int, iters: int) -> List[float]:
    """Milliseconds per call, the slowest rank's, each iteration started after a barrier."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        world.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return times


def single_gpu_call(kernel: str, q, k, v, recipe) -> Callable:
    if kernel == "sagekit":
        return lambda: sagekit.sageattn(q, k, v, layout="NHD", recipe=recipe)
    fn = sdpa_kernel(kernel)
    return lambda: fn(q, k, v)


def bench(world: World, args) -> List[Dict]:
    records = []
    device_name = torch.cuda.get_device_name(world.device)
    heads, d = args.heads, 128
    for dtype_name in args.dtypes.split(","):
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name]
        for n in (int(x) for x in args.seq_lens.split(",")):
            flops = 4.0 * n * n * heads * d
            q, k, v = make_inputs(n, heads, heads, d, dtype, world.device, seed=n)

            def record(impl, mode_name, ranks, ulysses, ring, times):
                ms = statistics.median(times)
                rec = dict(impl=impl, mode=mode_name, ranks=ranks, ulysses=ulysses, ring=ring,
                           n=n, heads=heads, d=d, causal=False, batch=1, dtype=dtype_name,
                           recipe=str(args.recipe) if impl.endswith("sagekit") else "fp16",
                           whole_call=True, ms=ms, ms_all=times, tops=flops / ms / 1e9,
                           device=device_name, iters=len(times))
                records.append(rec)
                world.say(f"{dtype_name} N={n:6d} {impl:18s} {mode_name:8s} x{ranks}: "
                          f"{ms:9.2f} ms {rec['tops']:7.1f} TOPS")

            for kernel in args.kernels.split(","):
                # One GPU: a plain call on rank 0 while the others wait.
                times = [0.0] * args.iters
                if world.rank == 0:
                    fn = single_gpu_call(kernel, q, k, v, args.recipe)
                    for _ in range(args.warmup):
                        fn()
                    times = []
                    for _ in range(args.iters):
                        torch.cuda.synchronize()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record(); fn(); e.record(); e.synchronize()
                        times.append(s.elapsed_time(e))
                shared = torch.tensor(times, device=world.device)
                dist.broadcast(shared, 0)
                record(f"single-{kernel}", "single", 1, 1, 1, shared.tolist())
                for mode in modes_for(world.size, causal=False):
                    run = runner(world, mode, kernel, args.recipe)
                    local = [shard(world, mode, x) for x in (q, k, v)]
                    times = time_call(world, lambda: run(*local, causal=False),
                                      args.warmup, args.iters)
                    record(f"{mode.engine}-{kernel}", mode.name, world.size, mode.ulysses,
                           mode.ring, times)
                torch.cuda.empty_cache()
            del q, k, v
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=["check", "bench"])
    p.add_argument("--out", required=True, help="JSON records, written by rank 0")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo and a float32 stand-in kernel (plumbing check only)")
    p.add_argument("--recipe", default="auto")
    p.add_argument("--check-n", type=int, default=4096, help="check: tokens of the sequence")
    p.add_argument("--seq-lens", default="65536,131072,262144", help="bench: sequence lengths")
    p.add_argument("--heads", type=int, default=24, help="bench: heads (Q and K/V)")
    p.add_argument("--dtypes", default="bfloat16,float16", help="bench: dtypes")
    p.add_argument("--kernels", default="sagekit,cudnn,flash", help="bench: kernels")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    world = World(args.device)
    if world.cpu:
        if args.task == "bench":
            p.error("bench needs --device cuda")
        install_cpu_reference_kernel()
    records = check(world, args) if args.task == "check" else bench(world, args)
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
