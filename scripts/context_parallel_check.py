"""Context parallelism on the FLASH_ATTN_CUDA provider: N GPUs against one.

Run with torchrun on one host, one process per GPU (``python3 -m torch.distributed.run``
where ``torchrun`` is not on PATH):

    torchrun --standalone --nproc_per_node 2 scripts/context_parallel_check.py --out cp.json
    torchrun --standalone --nproc_per_node 4 scripts/context_parallel_check.py --seqlen 8192
    torchrun --standalone --nproc_per_node 2 scripts/context_parallel_check.py --builtin
    # CPU smoke run (gloo, tiny sizes, our CPU kernels; no GPU needed):
    torchrun --standalone --nproc_per_node 2 scripts/context_parallel_check.py --device cpu \\
        --seqlen 64 --dim 64 --heads 2 --batch 1

What it checks, for each --seqlen. Every rank builds the same causal
self-attention layer (qkv projection, causal attention, output projection), the
same input x (batch, seqlen, dim) and the same output gradient (one seed).

1. References, on rank 0 alone, on the whole sequence (before the provider is
   activated): the layer in fp32 with SDPA's MATH backend on upcast weights and
   inputs (fp64 on the CPU), and the same layer in the run's dtype with torch's
   own kernels (built-in FLASH on CUDA; SDPA's CPU kernel in fp32 on the CPU).
   With the provider, rank 0 also runs our kernels on one device (reported only).
2. Context parallel: inside ``torch.distributed.tensor.experimental.context_parallel``
   x and the output gradient are split along the sequence over the ranks with
   torch's default load balancing (head-tail: 2 * nproc chunks, rank r holds
   chunks r and 2 * nproc - 1 - r), every rank runs the layer forward and
   backward on its shard, and SDPA becomes ring attention whose per-block flash
   ops are ours (or torch's with --builtin). The output and x's gradient are
   gathered back into sequence order (``context_parallel_unshard``); the
   weights' gradients are summed over the ranks in fp32.
3. The correctness criterion (docs/architecture.md), per tensor, against the
   fp32 reference:
   ``max|cp - ref32| <= 2 * max|torch_same_dtype - ref32| + 1e-5`` for the
   output, and 3x (plus 1e-5) for the gradients (x and every weight). With the
   provider, the run also fails when our overrides of
   aten::_scaled_dot_product_flash_attention (+ _backward) did not run under
   context parallelism.

CUDA: F.scaled_dot_product_attention under ``sdpa_kernel(FLASH_ATTENTION)``,
which context parallelism intercepts (it patches F.scaled_dot_product_attention).
CPU (gloo): SDPA on the CPU picks torch's CPU flash op, which context
parallelism does not intercept, so the layer calls
aten::_scaled_dot_product_flash_attention itself on sequence-sharded DTensors
(as context parallelism's own SDPA wrapper would), with our overrides registered
for the CPU key (torch has no CPU kernel for that op, so --builtin is refused on
the CPU).

Rank 0 prints the errors and writes a JSON (--out): world_size, provider,
device, torch / CUDA versions, commit (env FLASH_ATTN_CUDA_COMMIT or GIT_COMMIT,
else git), the command, and per sequence length every tensor's errors, limit
and verdict. Exit status 1 when any check fails. Every --seqlen must be
divisible by 2 * nproc.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import platform
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
except ImportError:  # pragma: no cover - where torch keeps it moved between releases
    from torch.distributed.tensor.experimental._context_parallel import context_parallel_unshard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from provenance import git_commit  # noqa: E402


def import_provider():
    """flash_attn_cuda's SDPA module (importing the package registers the provider),
    from the checkout when the package is built in place, else the installed one (an
    unbuilt checkout on sys.path would hide it)."""
    built_in_place = glob.glob(os.path.join(ROOT, "flash_attn_cuda", "_C.*"))
    if built_in_place and ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import flash_attn_cuda  # noqa: F401
    from flash_attn_cuda.integrations import sdpa as module

    return module


sdpa = None  # set by main()


# ---------------------------------------------------------------------------
# Run metadata
# ---------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def init_distributed(device_type: str):
    """The process group of torchrun's environment; a group of one without it."""
    if "WORLD_SIZE" not in os.environ:  # plain `python3 script.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)  # bound to this rank's GPU
    else:
        dist.init_process_group("gloo")
    return dist.get_world_size(), dist.get_rank()


# ---------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------


class CausalSelfAttention(torch.nn.Module):
    """qkv projection, causal attention over (batch, heads, seqlen, head_dim),
    output projection. `attention` picks the kernels: "math" (the fp32/fp64
    reference), "sdpa" (SDPA's own choice: the CPU reference in the run's
    dtype), "flash" (the FLASH backend: ours when the provider is active, torch's
    otherwise; on the CPU the aten op itself, on DTensors when `cp_mesh` is
    set)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.attention = "flash"
        self.cp_mesh = None

    def attend(self, q, k, v):
        if self.attention == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.device.type == "cuda":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                # Looked up at call time: context_parallel patches this attribute.
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # CPU: what context parallelism's SDPA wrapper does, on the aten op.
        if self.cp_mesh is not None:
            q, k, v = (
                DTensor.from_local(t, self.cp_mesh, [Shard(2)], run_check=False) for t in (q, k, v)
            )
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        return out.to_local() if isinstance(out, DTensor) else out

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


def run_layer(master, x, dout, dtype, attention):
    """Forward + backward of a copy of `master` in `dtype` on the whole sequence:
    (out, dx, {weight name: grad}), all in fp32/fp64 for comparison."""
    model = copy.deepcopy(master).to(dtype)
    model.attention = attention
    xi = x.to(dtype).clone().requires_grad_()
    out = model(xi)
    out.backward(dout.to(dtype))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    grads = {name: p.grad.to(wide) for name, p in model.named_parameters()}
    return out.detach().to(wide), xi.grad.to(wide), grads


def run_context_parallel(master, x, dout, dtype, mesh):
    """The layer forward + backward with the sequence split over the mesh:
    (out, dx) gathered back into sequence order, weight grads summed over ranks."""
    model = copy.deepcopy(master).to(dtype)
    model.attention = "flash"
    if x.device.type == "cpu":
        model.cp_mesh = mesh
    x_cp, dout_cp = x.to(dtype).clone(), dout.to(dtype).clone()  # sharded in place
    with context_parallel(mesh, buffers=[x_cp, dout_cp], buffer_seq_dims=[1, 1]):
        x_local = x_cp.clone().requires_grad_()
        out_local = model(x_local)
        out_local.backward(dout_cp)
        out, dx = context_parallel_unshard(mesh, [out_local.detach(), x_local.grad], [1, 1])
    wide = torch.float32
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.to(wide)
        dist.all_reduce(g)
        grads[name] = g
    return out.to(wide), dx.to(wide), grads


def max_abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------
# One sequence length
# ---------------------------------------------------------------------------


def check_seqlen(args, seqlen, dtype, device, mesh, world, rank, provider, calls):
    torch.manual_seed(args.seed + seqlen)  # the same weights and data on every rank
    master = CausalSelfAttention(args.dim, args.heads).to(device)
    x = torch.randn(args.batch, seqlen, args.dim, device=device)
    dout = torch.randn_like(x)
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32

    ref = same = single = None
    if rank == 0:
        ref = run_layer(master, x, dout, ref_dtype, "math")
        # torch's own kernels in the run's dtype; on CUDA the provider is not active yet.
        same = run_layer(master, x, dout, dtype, "flash" if device.type == "cuda" else "sdpa")

    handle = None
    if provider == "ours":
        if device.type == "cuda":
            torch.nn.attention.activate_flash_attention_impl(sdpa.PROVIDER_NAME)
        else:
            handle = sdpa._install(("CPU",))  # torch has no CPU kernel of its own here
    try:
        if rank == 0 and provider == "ours":
            single = run_layer(master, x, dout, dtype, "flash")
        before = dict(calls)
        dist.barrier()
        start = time.perf_counter()
        cp = run_context_parallel(master, x, dout, dtype, mesh)
        cp_seconds = time.perf_counter() - start
        ran = {k: n - before.get(k, 0) for k, n in calls.items() if n > before.get(k, 0)}
    finally:
        if handle is not None:
            handle.remove()
        elif provider == "ours":
            torch.nn.attention.restore_flash_attention_impl()

    failures = []
    if provider == "ours" and not (
        ran.get("_scaled_dot_product_flash_attention")
        and ran.get("_scaled_dot_product_flash_attention_backward")
    ):
        failures.append(
            f"rank {rank}: provider overrides did not run under context parallel (ran: {ran})"
        )
    errors = {}
    if rank == 0:
        names = ["out", "dx"] + [f"d{n}" for n in cp[2]]
        flat = lambda r: [r[0], r[1]] + list(r[2].values())  # noqa: E731
        for i, name in enumerate(names):
            factor = 2.0 if name == "out" else 3.0
            e_cp = max_abs(flat(cp)[i], flat(ref)[i])
            e_same = max_abs(flat(same)[i], flat(ref)[i])
            limit = factor * e_same + 1e-5
            finite = bool(torch.isfinite(flat(cp)[i]).all())
            row = dict(
                cp=e_cp,
                torch_same_dtype=e_same,
                limit=limit,
                ok=bool(finite and e_cp <= limit),
                ref_max=flat(ref)[i].abs().max().item(),
            )
            if single is not None:
                row["ours_one_device"] = max_abs(flat(single)[i], flat(ref)[i])
                row["cp_vs_ours_one_device"] = max_abs(flat(cp)[i], flat(single)[i])
            if not row["ok"]:
                failures.append(
                    f"{name}: max|cp - ref| {e_cp:.3e} > limit {limit:.3e}"
                    + ("" if finite else " (non-finite values)")
                )
            errors[name] = row

    # Every rank's verdict reaches rank 0 (the provider-ran check is per rank).
    gathered = [None] * world
    dist.all_gather_object(gathered, failures)
    all_failures = [f for part in gathered for f in part]
    return dict(
        seqlen=seqlen,
        errors=errors,
        overrides_run_rank0=ran if rank == 0 else None,
        cp_step_seconds=cp_seconds,
        failures=sorted(set(all_failures)),
        passed=not all_failures,
    )


def main():
    global sdpa
    sdpa = import_provider()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument(
        "--seqlen",
        type=int,
        nargs="+",
        default=[8192, 4040],
        help="total sequence lengths (each divisible by 2 * nproc); 4040 "
        "gives chunks that are not a multiple of any tile size",
    )
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="default bf16 on CUDA, fp32 on the CPU",
    )
    parser.add_argument(
        "--builtin",
        action="store_true",
        help="torch's own FLASH kernels instead of the provider (CUDA only)",
    )
    parser.add_argument(
        "--rotate",
        choices=["allgather", "alltoall"],
        default=None,
        help="context parallelism's K/V rotation (default: torch's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file written by rank 0")
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu")
    if args.device == "cpu" and args.builtin:
        raise SystemExit(
            "--builtin needs CUDA: torch has no CPU kernel of "
            "aten::_scaled_dot_product_flash_attention for ring attention to call"
        )
    dtype_name = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    if args.device == "cuda" and dtype == torch.float32:
        raise SystemExit("the FLASH backend takes fp16 / bf16 on CUDA")
    provider = "builtin" if args.builtin else "ours"
    if provider == "ours" and args.device == "cuda" and not sdpa.registry_available():
        raise SystemExit(f"torch {torch.__version__} has no flash-attention registry (2.10+)")

    world, rank = init_distributed(args.device)
    device = (
        torch.device(args.device, torch.cuda.current_device())
        if args.device == "cuda"
        else torch.device("cpu")
    )
    mesh = init_device_mesh(args.device, (world,))
    for s in args.seqlen:
        if s % (2 * world):
            raise SystemExit(f"--seqlen {s} must be divisible by 2 * nproc = {2 * world}")
    if args.rotate:
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(args.rotate)

    calls = {}
    for name, fn in list(sdpa._OVERRIDES.items()):  # counted by every installation below

        def counting(*a, _fn=fn, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)

        sdpa._OVERRIDES[name] = counting

    cases = [
        check_seqlen(args, s, dtype, device, mesh, world, rank, provider, calls)
        for s in args.seqlen
    ]
    passed = all(c["passed"] for c in cases)
    if rank == 0:
        kernels = "torch built-in FLASH" if args.builtin else sdpa.PROVIDER_NAME
        print(
            f"{world} ranks ({args.device}), {kernels}, {dtype_name}, batch {args.batch}, "
            f"dim {args.dim}, heads {args.heads} (head dim {args.dim // args.heads})"
        )
        for case in cases:
            print(f" seqlen {case['seqlen']}: {'OK' if case['passed'] else 'FAILED'}")
            for name, row in case["errors"].items():
                extra = (
                    f"  one device {row['ours_one_device']:.2e}" if "ours_one_device" in row else ""
                )
                print(
                    f"  {name:>12}: cp {row['cp']:.2e}  torch {row['torch_same_dtype']:.2e}"
                    f"  limit {row['limit']:.2e}{extra}  {'ok' if row['ok'] else 'FAIL'}"
                )
            print(f"  overrides run under context parallel (rank 0): {case['overrides_run_rank0']}")
            for f in case["failures"]:
                print(f"  FAILED: {f}")
        print("OK" if passed else "FAILED")
        if args.out:
            record = dict(
                kind="context_parallel_check",
                world_size=world,
                provider=provider,
                kernels=kernels,
                passed=passed,
                device_type=args.device,
                device=device_name(device),
                device_count=torch.cuda.device_count() if args.device == "cuda" else 0,
                torch=torch.__version__,
                cuda=torch.version.cuda,
                python=platform.python_version(),
                commit=git_commit(),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                load_balance=True,
                rotate=args.rotate or "torch default",
                config=dict(
                    batch=args.batch,
                    dim=args.dim,
                    heads=args.heads,
                    head_dim=args.dim // args.heads,
                    dtype=dtype_name,
                    causal=True,
                ),
                criterion="max|cp - ref32| <= 2x (output) / 3x (gradients) "
                "max|torch_same_dtype - ref32| + 1e-5",
                cases=cases,
            )
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
            print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    # The results are written and the group is gone; skip the interpreter's teardown, where
    # gloo's worker threads can still call std::terminate (a SIGABRT after a passing run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if passed else 1)


if __name__ == "__main__":
    main()
