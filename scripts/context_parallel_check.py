"""Context parallelism on the FLASH_ATTN_CUDA provider: N GPUs against one.

Run with torchrun on one host, one process per GPU:

    torchrun --nproc_per_node 2 scripts/context_parallel_check.py
    torchrun --nproc_per_node 4 scripts/context_parallel_check.py --seqlen 8192 --dtype fp16
    torchrun --nproc_per_node 2 scripts/context_parallel_check.py --builtin  # built-in kernels

What it checks. Every rank builds the same causal self-attention layer
(qkv projection, F.scaled_dot_product_attention(is_causal=True) under the
FLASH backend, output projection) and the same input x (batch, seqlen, dim)
and output gradient. With the provider active (unless --builtin):

1. Reference, on each rank's GPU alone: forward and backward of the layer on
   the whole sequence.
2. Context parallel: inside torch.distributed.tensor.experimental.context_parallel
   the sequence of x and of the output gradient is split over the ranks (with
   torch's default load balancing); each rank runs the layer on its shard, and
   SDPA becomes ring attention whose per-block flash ops are ours.
   The output and x's gradient are gathered back into sequence order
   (context_parallel_unshard); the weights' gradients are summed over ranks.
3. Rank 0 prints the largest differences and how many times our forward and
   backward overrides ran; the script exits with status 1 when a difference is
   above the tolerance (relative to the reference's largest magnitude:
   2e-2 for the output, 5e-2 for gradients, bf16/fp16 inputs) or when
   the provider was active and its overrides did not run.

The sequence length must be divisible by 2 * nproc (load balancing splits it
into 2 * nproc chunks).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_cuda  # noqa: F401  (registers the provider)
from flash_attn_cuda.integrations import sdpa


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


def count_calls():
    calls = {}
    for name, fn in list(sdpa._OVERRIDES.items()):
        def counting(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        sdpa._OVERRIDES[name] = counting
    return calls


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--builtin", action="store_true", help="torch's own FLASH kernels")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = init_device_mesh("cuda", (world,))
    if args.seqlen % (2 * world):
        raise SystemExit(f"--seqlen must be divisible by 2 * nproc = {2 * world}")

    calls = count_calls()
    if not args.builtin:
        torch.nn.attention.activate_flash_attention_impl(sdpa.PROVIDER_NAME)

    torch.manual_seed(0)  # the same weights and data on every rank
    model = CausalSelfAttention(args.dim, args.heads).cuda().to(dtype)
    x = torch.randn(args.batch, args.seqlen, args.dim, device="cuda", dtype=dtype)
    dout = torch.randn_like(x)

    # 1. One GPU, whole sequence.
    x_ref = x.clone().requires_grad_()
    out_ref = model(x_ref)
    out_ref.backward(dout)
    grads_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    calls_single = dict(calls)

    # 2. Split over the ranks.
    x_cp, dout_cp = x.clone(), dout.clone()
    with context_parallel(mesh, buffers=[x_cp, dout_cp], buffer_seq_dims=[1, 1]):
        x_local = x_cp.clone().requires_grad_()
        out_local = model(x_local)
        out_local.backward(dout_cp)
        out_full, dx_full = context_parallel_unshard(
            mesh, [out_local.detach(), x_local.grad], [1, 1]
        )
    for p in model.parameters():
        dist.all_reduce(p.grad)

    # 3. Compare.
    errors = {"out": rel_err(out_full, out_ref), "dx": rel_err(dx_full, x_ref.grad)}
    for (name, p), g in zip(model.named_parameters(), grads_ref):
        errors[f"d{name}"] = rel_err(p.grad, g)
    limits = {name: (2e-2 if name == "out" else 5e-2) for name in errors}
    ran = {k: calls.get(k, 0) - calls_single.get(k, 0) for k in calls}
    failed = [name for name in errors if not errors[name] <= limits[name]]
    if not args.builtin and not (
        ran.get("_scaled_dot_product_flash_attention")
        and ran.get("_scaled_dot_product_flash_attention_backward")
    ):
        failed.append("provider overrides did not run under context parallel")
    status = torch.tensor([len(failed)], device="cuda")
    dist.all_reduce(status)
    if rank == 0:
        kernels = "torch built-in FLASH" if args.builtin else sdpa.PROVIDER_NAME
        print(f"{world} ranks, {kernels}, {args.dtype}, batch {args.batch}, seqlen "
              f"{args.seqlen}, dim {args.dim}, heads {args.heads}")
        for name, err in errors.items():
            print(f"  {name:>12}: max rel diff {err:.3e} (limit {limits[name]:.0e})")
        print(f"  overrides run under context parallel on rank 0: {ran}")
        print("FAILED: " + "; ".join(failed) if status.item() else "OK")
    if not args.builtin:
        torch.nn.attention.restore_flash_attention_impl()
    dist.destroy_process_group()
    sys.exit(1 if status.item() else 0)


if __name__ == "__main__":
    main()
