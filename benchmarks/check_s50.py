"""Session 50's fixes on CUDA (NCCL, one GPU; run under torchrun): FSDP / ZeRO-2's gathered weights after an
optimizer step that followed a forward without its backward, and a GAN's discriminator frozen for the
generator's step (DDP and FSDP), each against one process on the same GPU, parameters after every step.
Writes ``check_s50.json`` into the directory given."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed_training import DDP, FSDP
from distributed_training.runtime import init_distributed


def mlp() -> nn.Module:
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh())  # noqa: E731
    return nn.Sequential(nn.Linear(32, 64), block(), block(), nn.Linear(64, 8)).cuda()


def stale(reshard: bool) -> list[float]:
    model = mlp()
    reference = copy.deepcopy(model)
    fsdp = FSDP(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    worst = []
    for step in range(5):
        g = torch.Generator(device="cuda").manual_seed(step)
        x, x2 = torch.randn(16, 32, device="cuda", generator=g), torch.randn(16, 32, device="cuda", generator=g)
        y = torch.randint(0, 8, (16,), device="cuda", generator=g)
        for net, o in ((fsdp, opt), (reference, ref_opt)):
            o.zero_grad()
            F.cross_entropy(net(x), y).backward()
            net.eval()
            F.cross_entropy(net(x2), y)  # never backpropagated
            net.train()
            o.step()
        full = fsdp.full_state_dict(rank0_only=False)
        worst.append(max((full[k].cuda() - v).abs().max().item() for k, v in reference.state_dict().items()))
    return worst


def gan(kind: str) -> list[float]:
    def nets():
        torch.manual_seed(1)
        return nn.Linear(16, 32).cuda(), mlp()[:3].append(nn.Linear(64, 1).cuda())

    ref_g, ref_d = nets()
    gen, disc = nets()
    gen, disc = DDP(gen), (DDP(disc) if kind == "ddp" else FSDP(disc))
    worst = []
    opts = [[torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in pair] for pair in ((gen, disc), (ref_g, ref_d))]
    for step in range(5):
        g = torch.Generator(device="cuda").manual_seed(step)
        real, z = torch.randn(16, 32, device="cuda", generator=g), torch.randn(16, 16, device="cuda", generator=g)
        for (G, D), (opt_g, opt_d) in zip(((gen, disc), (ref_g, ref_d)), opts):
            opt_d.zero_grad()
            (D(G(z).detach()).mean() - D(real).mean()).backward()
            opt_d.step()
            for p in D.parameters():
                p.requires_grad_(False)
            opt_g.zero_grad()
            (-D(G(z)).mean()).backward()
            opt_g.step()
            for p in D.parameters():
                p.requires_grad_(True)
        full = disc.full_state_dict(rank0_only=False) if kind == "fsdp" else disc.module.state_dict()
        worst.append(max([(full[k].cuda() - v).abs().max().item() for k, v in ref_d.state_dict().items()]
                         + [(a - b).abs().max().item() for a, b in zip(gen.module.parameters(), ref_g.parameters())]))
    return worst


def main(out: str) -> None:
    ctx = init_distributed()
    torch.cuda.set_device(ctx.local_rank)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": ctx.world_size,
               "forward_without_backward_then_step": {"zero3": stale(True), "zero2": stale(False)},
               "gan_discriminator_frozen": {"ddp": gan("ddp"), "fsdp": gan("fsdp")}}
    if ctx.rank == 0:
        with open(f"{out}/check_s50.json", "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
