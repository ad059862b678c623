"""Session 49, on CUDA (torchrun, 1 GPU, NCCL): FSDP with MixedPrecision(bf16 weights, fp32 reduction) sums
the gradients of 16 micro-batches under no_sync in fp32 (was: autograd's bf16 adds), against the same bf16
micro-batch gradients summed in fp32 and in bf16 by a plain copy of the model; and the fp16 trainer's loss
scaler with hysteresis 2 backing off on overflows between clean steps. Writes a JSON line to $OUT."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distributed_training import FSDP, DynamicLossScaler, MixedPrecision


def main(out: str) -> None:
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16)).to(device)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    micro = 16
    xs = [torch.randn(32, 256, device=device) for _ in range(micro)]
    ys = [torch.randint(0, 16, (32,), device=device) for _ in range(micro)]
    fsdp = FSDP(model, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32), device=device)
    for k in range(micro):
        with (torch.enable_grad() if k == micro - 1 else fsdp.no_sync()):
            F.cross_entropy(fsdp(xs[k]).float(), ys[k]).div(micro).backward()
    ours = torch.cat([p.grad.flatten() for p in fsdp.parameters()])
    in32 = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    in16 = [torch.zeros_like(p) for p in ref.parameters()]
    for k in range(micro):
        ref.zero_grad(set_to_none=True)
        F.cross_entropy(ref(xs[k].to(torch.bfloat16)).float(), ys[k]).div(micro).backward()
        for a, b, p in zip(in32, in16, ref.parameters()):
            a += p.grad.float()
            b += p.grad
    full32 = torch.cat([a.flatten() for a in in32])
    full16 = torch.cat([b.float().flatten() for b in in16])
    n = min(ours.numel(), full32.numel())
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "fsdp_vs_fp32_sum": (ours[:n] - full32[:n]).abs().max().item(),
              "bf16_sum_vs_fp32_sum": (full16[:n] - full32[:n]).abs().max().item(),
              "largest_gradient": full32.abs().max().item()}
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=100, hysteresis=2)
    p = nn.Parameter(torch.ones(3, device=device))
    opt = torch.optim.SGD([p], lr=0.1)
    scales = []
    for k in range(10):
        p.grad = torch.full((3,), float("inf") if k % 2 == 0 else 1.0, device=device)
        scaler.step(opt, [p.grad])
        scales.append(scaler.scale)
    result["scaler_scales"] = scales
    print(json.dumps(result))
    with open(os.path.join(out, "fsdp_accumulation.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
