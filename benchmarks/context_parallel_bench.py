#!/usr/bin/env python3
"""A long-sequence training step under context parallelism: tokens/s, memory, communication.

    # 2 GPUs, 128k tokens, our kernels (the SDPA provider) / torch's FLASH kernels:
    torchrun --standalone --nproc_per_node 2 benchmarks/context_parallel_bench.py \\
        --provider ours --seqlen 131072 --out results/
    torchrun --standalone --nproc_per_node 2 benchmarks/context_parallel_bench.py \\
        --provider builtin --seqlen 131072 --out results/
    # one GPU, no context parallelism: the largest of these lengths that fits
    python3 benchmarks/context_parallel_bench.py --provider ours --seqlen 131072 65536 32768
    # CPU smoke run (gloo, tiny model, our CPU kernels):
    torchrun --standalone --nproc_per_node 2 benchmarks/context_parallel_bench.py \\
        --device cpu --seqlen 128 --layers 1 --hidden 64 --head-dim 32 --vocab 64

The model (written here, no transformers): token embedding, --layers pre-norm
decoder blocks (RMSNorm, qkv projection, causal F.scaled_dot_product_attention
under the FLASH backend with heads of --head-dim, output projection, RMSNorm, a
GELU MLP of --mlp-ratio * hidden), final RMSNorm, a --vocab LM head, cross
entropy against the next token. No positional encoding (RoPE would need its
position buffer sharded like the tokens; it does not change the attention
cost). bf16 weights, AdamW. The tokens are random.

A training step: forward, backward, the gradients' all-reduce (sum, then divided
by the world size: every rank holds every weight, as with DDP), AdamW. Under
context parallelism (world size > 1) the step runs inside
``torch.distributed.tensor.experimental.context_parallel`` with torch's default
load balancing: tokens and labels of length --seqlen are split along the sequence
into 2 * world chunks, rank r keeps chunks r and 2 * world - 1 - r, and SDPA
becomes ring attention (K/V rotated by --rotate, torch's default all-gather
unless given). The loss is each rank's mean over its tokens; with equal shards
the average of the ranks' gradients is that of the whole sequence. With world
size 1 the same step runs without context parallelism: the baseline. Several
--seqlen values (world size 1 only) are tried in order, the first that does not
run out of memory is measured and the ones that did are recorded.

--provider ours activates the FLASH_ATTN_CUDA provider (every ring-attention block
runs flash_attn_cuda's kernels); builtin keeps torch's own FLASH kernels; cudnn
selects SDPA's cuDNN backend instead (where the installed torch's context
parallelism handles aten::_scaled_dot_product_cudnn_attention).

What is reported (JSON, rank 0 writes it; every per-GPU number is given per rank):

- step time: ``--warmup`` steps, then ``--iters`` timed steps, each started
  after a barrier and ended by a device synchronize; a step's time is the
  slowest rank's, and the reported time is the median over the timed steps.
- tokens/s per GPU: batch * seqlen / world_size / step time.
- peak memory per GPU: ``torch.cuda.max_memory_allocated`` over the timed steps
  (reset after warm-up), and ``max_memory_reserved``.
- communication: one more step under ``torch.profiler`` (after the timed ones,
  so the profiler's overhead is in no timed number). From its trace, on each
  rank: ``comm_kernel_share`` = total time of NCCL kernels / the profiled step's
  wall time; ``comm_exposed_share`` = time during which an NCCL kernel ran and no
  other kernel did / the same wall time. The first is an upper bound on the time
  in communication (NCCL kernels that overlap compute count in full); the second
  is what communication (including waiting for a slower peer, which an NCCL
  kernel spends spinning) adds to that GPU's critical path, a lower bound on
  its cost when compute kernels would also have run slower beside it. Both are
  null on the CPU (gloo runs no kernels) and with --no-profile.

Keep the iterations small (the defaults: warm-up 2, timed 3): at 128k tokens on
two H100s one step of the default model takes about 1-3 s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import json
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:  # also when imported from elsewhere (the tests)
    sys.path.insert(0, BENCH_DIR)
from provenance import git_commit  # noqa: E402

PROVIDER = "FLASH_ATTN_CUDA"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKENDS = {
    "ours": SDPBackend.FLASH_ATTENTION,
    "builtin": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, hidden, head_dim, mlp_ratio, attend):
        super().__init__()
        self.heads = hidden // head_dim
        self.attend = attend
        self.norm1 = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, mlp_ratio * hidden, bias=False)
        self.fc2 = torch.nn.Linear(mlp_ratio * hidden, hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class Decoder(torch.nn.Module):
    def __init__(self, vocab, hidden, layers, head_dim, mlp_ratio, attend):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            Block(hidden, head_dim, mlp_ratio, attend) for _ in range(layers)
        )
        self.norm = torch.nn.RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def make_attend(device_type, backend, cp_mesh_ref):
    """Causal attention on (batch, heads, seqlen, head_dim). CUDA: SDPA under
    `backend` (context parallelism patches F.scaled_dot_product_attention and
    intercepts it). CPU: SDPA's CPU kernel is not intercepted, so call
    aten::_scaled_dot_product_flash_attention (our CPU overrides) on DTensors
    sharded along the sequence, as context parallelism's SDPA wrapper does."""
    if device_type == "cuda":

        def attend(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return attend

    from torch.distributed.tensor import DTensor, Shard

    def attend_cpu(q, k, v):
        mesh = cp_mesh_ref[0]
        if mesh is not None:
            q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        return out.to_local() if isinstance(out, DTensor) else out

    return attend_cpu


# ---------------------------------------------------------------------------
# Communication share from a profiler trace
# ---------------------------------------------------------------------------


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(merged):
    return sum(end - start for start, end in merged)


def _intersection(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def comm_from_trace(path, wall_us):
    """NCCL kernel time and exposed NCCL time (us) of a chrome trace."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    comm, compute = [], []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        interval = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        (comm if "nccl" in e.get("name", "").lower() else compute).append(interval)
    comm_u, compute_u = _union(comm), _union(compute)
    comm_total = sum(end - start for start, end in comm)
    exposed = _length(comm_u) - _length(_intersection(comm_u, compute_u))
    return dict(
        comm_kernel_ms=comm_total / 1e3,
        comm_exposed_ms=exposed / 1e3,
        compute_kernel_busy_ms=_length(compute_u) / 1e3,
        nccl_kernels=len(comm),
        profiled_step_ms=wall_us / 1e3,
        comm_kernel_share=comm_total / wall_us if wall_us else None,
        comm_exposed_share=exposed / wall_us if wall_us else None,
    )


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, seqlen, device, dtype, world, rank, mesh):
    cp_mesh_ref = [None]
    torch.manual_seed(args.seed)  # the same weights on every rank
    attend = make_attend(device.type, BACKENDS[args.provider], cp_mesh_ref)
    model = Decoder(args.vocab, args.hidden, args.layers, args.head_dim, args.mlp_ratio, attend).to(
        device=device, dtype=dtype
    )
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    n_params = sum(p.numel() for p in params)
    seq = torch.randint(0, args.vocab, (args.batch, seqlen + 1), device=device)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    if world > 1:
        from torch.distributed.tensor.experimental import context_parallel

        cp_context = lambda: context_parallel(  # noqa: E731
            mesh,
            buffers=[tokens, labels],
            buffer_seq_dims=[1, 1],
            no_restore_buffers={tokens, labels},
        )
        if device.type == "cpu":
            cp_mesh_ref[0] = mesh
    else:
        cp_context = contextlib.nullcontext

    def step():
        loss = model(tokens, labels)
        loss.backward()
        if world > 1:
            for p in params:
                dist.all_reduce(p.grad)
            torch._foreach_div_([p.grad for p in params], float(world))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times = []
    profile = None
    with cp_context():
        local_tokens = tokens.numel()
        for i in range(args.warmup + args.iters):
            if i == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if world > 1:
                dist.barrier()
            sync(device)
            start = time.perf_counter()
            loss = step()
            sync(device)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                times.append(elapsed)
        loss = float(loss)
        peak = reserved = None
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.max_memory_reserved(device)
        if args.profile and device.type == "cuda":
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            if world > 1:
                dist.barrier()
            sync(device)
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                step()
                sync(device)
                wall_us = (time.perf_counter() - start) * 1e6
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(path)
                profile = comm_from_trace(path, wall_us)

    # Every rank's numbers reach every rank; a step lasts as long as its slowest rank.
    mine = dict(
        rank=rank,
        step_s=times,
        peak_mem_bytes=peak,
        reserved_mem_bytes=reserved,
        local_tokens=local_tokens,
        comm=profile,
    )
    per_rank = [None] * world
    if world > 1:
        dist.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    step_s = [max(r["step_s"][i] for r in per_rank) for i in range(args.iters)]
    median = statistics.median(step_s)
    tokens_total = args.batch * seqlen
    result = dict(
        seqlen=seqlen,
        tokens_per_step=tokens_total,
        step_s_median=median,
        step_s=step_s,
        tokens_per_s=tokens_total / median,
        tokens_per_s_per_gpu=tokens_total / world / median,
        loss=loss,
        params=n_params,
        per_rank=per_rank,
        peak_mem_gib_max=(
            max(r["peak_mem_bytes"] for r in per_rank) / 2**30 if peak is not None else None
        ),
    )
    if all(r["comm"] for r in per_rank):
        for key in ("comm_kernel_share", "comm_exposed_share"):
            result[key + "_mean"] = statistics.mean(r["comm"][key] for r in per_rank)
    return result  # the model, its gradients and the optimizer state go with this frame


def is_oom(error):
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=list(BACKENDS), default="ours")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--seqlen",
        type=int,
        nargs="+",
        default=None,
        help="total tokens per sequence (default 65536 * world size); with "
        "world size 1, several lengths: the first that fits is measured",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mlp-ratio", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rotate", choices=["allgather", "alltoall"], default=None)
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip the profiled step (no communication share)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default=None,
        help="a .json file, or a folder for cp_bench_<provider>_ws<N>.json "
        "(default benchmarks/out/<device>/context_parallel/)",
    )
    args = parser.parse_args()
    if args.hidden % args.head_dim:
        raise SystemExit("--hidden must be a multiple of --head-dim")

    if "WORLD_SIZE" not in os.environ:  # plain python: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --device cpu")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        if args.provider != "ours":
            raise SystemExit(
                "on the CPU only --provider ours runs (our CPU kernels behind "
                "aten::_scaled_dot_product_flash_attention; torch has none)"
            )
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    seqlens = args.seqlen or [65536 * world]
    if world > 1 and len(seqlens) > 1:
        raise SystemExit("several --seqlen values are tried only with world size 1")

    mesh = None
    rank = 0
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)  # bound to this rank's GPU
        else:
            dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh(device.type, (world,))
        if args.rotate:
            from torch.distributed.tensor.experimental._attention import set_rotate_method

            set_rotate_method(args.rotate)
        for s in seqlens:
            if s % (2 * world):
                raise SystemExit(f"--seqlen {s} must be divisible by 2 * nproc = {2 * world}")

    # The checkout when it is built in place, else the installed package (which an unbuilt
    # checkout on sys.path would hide).
    if glob.glob(os.path.join(ROOT, "flash_attn_cuda", "_C.*")) and ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import flash_attn_cuda  # noqa: F401  (registers the provider)
    from flash_attn_cuda.integrations import sdpa

    handle = None
    if args.provider == "ours":
        if device.type == "cuda":
            if not sdpa.registry_available():
                raise SystemExit(f"torch {torch.__version__} has no flash-attention registry")
            torch.nn.attention.activate_flash_attention_impl(PROVIDER)
        else:
            handle = sdpa._install(("CPU",))

    result, oom, error = None, [], None
    try:
        for s in seqlens:
            try:
                result = measure(args, s, device, dtype, world, rank, mesh)
                break
            except Exception as e:  # noqa: BLE001 - an OOM moves on to the next length
                if world > 1 or not is_oom(e):
                    traceback.print_exc()
                    error = f"seqlen {s}: {type(e).__name__}: {str(e).splitlines()[0][:500]}"
                    break
                oom.append(s)
                print(f"seqlen {s}: out of memory on one GPU, trying the next length", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if result is None and error is None:
            error = f"out of memory at every --seqlen {seqlens}"
    finally:
        if handle is not None:
            handle.remove()
        elif args.provider == "ours" and device.type == "cuda":
            torch.nn.attention.restore_flash_attention_impl()

    if rank == 0:
        name = (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else (platform.processor() or platform.machine() or "cpu")
        )
        record = dict(
            kind="context_parallel_bench",
            world_size=world,
            provider=args.provider,
            kernels={"ours": PROVIDER, "builtin": "torch built-in FLASH", "cudnn": "torch cuDNN"}[
                args.provider
            ],
            context_parallel=world > 1,
            load_balance=world > 1,
            rotate=(args.rotate or "torch default") if world > 1 else None,
            device_type=device.type,
            device=name,
            torch=torch.__version__,
            cuda=torch.version.cuda,
            python=platform.python_version(),
            commit=git_commit(),
            command=" ".join(
                ["torchrun", f"--nproc_per_node {world}"]
                if world > 1
                else [os.path.basename(sys.executable)]
            )
            + " "
            + " ".join(sys.argv),
            config=dict(
                batch=args.batch,
                layers=args.layers,
                hidden=args.hidden,
                head_dim=args.head_dim,
                heads=args.hidden // args.head_dim,
                mlp_ratio=args.mlp_ratio,
                vocab=args.vocab,
                dtype=str(dtype).replace("torch.", ""),
                warmup=args.warmup,
                iters=args.iters,
                seqlens_tried=seqlens,
            ),
            oom_at=oom,
            error=error,
            result=result,
        )
        if result:
            gib = result["peak_mem_gib_max"]
            share = result.get("comm_kernel_share_mean")
            exposed = result.get("comm_exposed_share_mean")
            print(
                f"{args.provider} ws={world} seqlen {result['seqlen']}: step "
                f"{result['step_s_median'] * 1e3:.1f} ms, "
                f"{result['tokens_per_s_per_gpu']:.0f} tokens/s per GPU"
                + (f", peak {gib:.2f} GiB" if gib is not None else "")
                + (
                    f", NCCL kernels {share:.1%} / exposed {exposed:.1%} of the step"
                    if share is not None
                    else ""
                ),
                flush=True,
            )
        out = args.out or os.path.join(BENCH_DIR, "out", sanitize(name), "context_parallel")
        if not out.endswith(".json"):
            out = os.path.join(out, f"cp_bench_{args.provider}_ws{world}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {out}", flush=True)
    if world > 1 and result is not None:  # after an error a peer may be stuck: just exit
        dist.barrier()
        dist.destroy_process_group()
    # Skip the interpreter's teardown either way: after an error a peer may be stuck in a
    # collective, and after a clean run gloo's worker threads can still call std::terminate
    # while the interpreter finalizes (a SIGABRT after the results were written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result is not None else 1)


if __name__ == "__main__":
    main()
