"""On GPUs with NCCL (one, or two when there are): `trainer.summon_full_params()` under ZeRO-3 with bf16
compute and under FSDP with CPU offload gives the module the shards' fp32 values (on the GPU; on the CPU
with offload), HF-style
`generate()` runs inside it, the module called outside it is refused, and `evaluate()` with the first
replica's BatchNorm statistics scores what `full_state_dict()` exports; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_training import DistributedTrainer, FSDPStrategy, MixedPrecision
from distributed_training.testing import run_distributed

from test_trial_s32 import TinyLM, _bn_data, _bn_model, _loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_worker(rank, world):
    out = {}
    for name, strategy in (("zero3-bf16", FSDPStrategy(mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))),
                           ("fsdp-offload", FSDPStrategy(cpu_offload=True))):
        torch.manual_seed(0)
        trainer = DistributedTrainer(TinyLM(), lambda ps: torch.optim.AdamW(ps, lr=0.05), strategy=strategy,
                                     progress=False)
        data = torch.randint(0, 11, (3, 4, 5), generator=torch.Generator().manual_seed(1))
        for batch in data:
            trainer.train_step((batch[:, :-1], batch[:, 1:]), _loss)
        prompt = torch.tensor([[1, 2, 3]], device=trainer.device)
        try:
            trainer.module(prompt)
            refused = False
        except RuntimeError as err:
            refused = "summon_full_params" in str(err)
        full = trainer.full_state_dict()
        with trainer.summon_full_params():
            params = dict(trainer.module.named_parameters())
            where = {str(p.device) for p in params.values()} | {str(p.dtype) for p in params.values()}
            state = {k: v.detach().cpu().clone() for k, v in trainer.module.state_dict().items()}
            generated = trainer.module.generate(prompt, steps=3).cpu()
        same = rank != 0 or all(torch.equal(state[k], v) for k, v in full.items())
        trainer.close()
        out[name] = (refused, sorted(where), same, generated.tolist())
    trainer = DistributedTrainer(_bn_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero3", progress=False)
    for step in range(3):
        x, y = _bn_data(8, 10 * step + rank)
        trainer.train_step((x * (rank + 1), y), nn.functional.mse_loss)
    scored = trainer.evaluate(torch.utils.data.TensorDataset(*_bn_data(10, 99)), nn.functional.mse_loss, batch_size=4)
    out["evaluate"] = (scored["loss"], trainer.full_state_dict())
    trainer.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_summon_and_evaluate_on_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_distributed(gpu_worker, world, backend="nccl", timeout=240)
    for rank, out in enumerate(results):
        for name in ("zero3-bf16", "fsdp-offload"):
            refused, where, same, generated = out[name]
            assert refused and same, (rank, name, out[name])
            device = "cpu" if name == "fsdp-offload" else "cuda:0" if world == 1 else f"cuda:{rank}"  # offload: on the CPU
            assert where == sorted([device, "torch.float32"]), (rank, name, where)
            assert len(generated[0]) == 6 and generated == results[0][name][3], (rank, name)
    loss = results[0]["evaluate"][0]
    model = _bn_model()
    model.load_state_dict({k: v.cpu() for k, v in results[0]["evaluate"][1].items()})
    model.eval()
    x, y = _bn_data(10, 99)
    with torch.no_grad():
        expected = nn.functional.mse_loss(model(x), y).item()
    assert all(abs(out["evaluate"][0] - expected) < 1e-5 for out in results), (loss, expected)
