"""`CompiledLoss` (the trainer's ``pipeline_compile_loss``): equal to the loss as it is, compiled or not; a
compiler that fails leaves the loss as it is (one warning), an error of the inputs stays the inputs'; the
option's checks and what it changes in the compute balance. The compiled loss itself on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from distributed_training.models import GPTConfig
from distributed_training.pipeline import CompiledLoss, GPTStages, lm_loss
from distributed_training.pipeline.gpt_stages import gpt_layer_costs
from distributed_training.pipeline.options import PipelineOptions


def _logits(device="cpu", dtype=torch.float32, vocab=37):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, vocab, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (3, 5), generator=g).to(device)
    targets[0, 0] = -100  # ignored, as lm_loss's cross-entropy does
    return logits, targets


def _value_and_grad(fn, logits, targets):
    loss = fn(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


def test_compiled_through_dynamo_equals_the_loss_as_it_is():
    logits, targets = _logits()
    compiled = CompiledLoss(lm_loss, devices=("cpu",), backend="eager")  # dynamo's graph, run by torch
    want, got = _value_and_grad(lm_loss, logits, targets), _value_and_grad(compiled, logits, targets)
    assert compiled._compiled is not None and compiled.failure is None
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_other_devices_run_the_loss_as_it_is():
    logits, targets = _logits()
    compiled = CompiledLoss(lm_loss)  # CUDA only
    torch.testing.assert_close(compiled(logits, targets), lm_loss(logits, targets), rtol=0, atol=0)
    assert compiled._compiled is None


def test_a_failing_compiler_warns_once_and_leaves_the_loss_as_it_is():
    calls = []

    def broken(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no compiler here")

    logits, targets = _logits()
    compiled = CompiledLoss(lm_loss, devices=("cpu",), backend=broken)
    with pytest.warns(RuntimeWarning, match="pipeline_compile_loss: compiling the loss failed.*no compiler here"):
        got = _value_and_grad(compiled, logits, targets)
    torch.testing.assert_close(got, _value_and_grad(lm_loss, logits, targets), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(logits, targets)  # not compiled again, not warned again
    assert len(calls) == 1 and "no compiler here" in compiled.failure and "failed" in repr(compiled)


def test_a_backward_the_compiler_fails_on_falls_back_before_the_step_goes_on():
    """AOTAutograd compiles the backward lazily; CompiledLoss makes it compile with the forward, so that
    its failure is caught where the forward's is (not raised by the step's backward, every step)."""
    from torch._dynamo.backends.common import aot_autograd

    def no_backward(gm, example_inputs):
        raise RuntimeError("no backward compiler")

    logits, targets = _logits()
    compiled = CompiledLoss(lm_loss, devices=("cpu",),
                            backend=aot_autograd(fw_compiler=lambda gm, example_inputs: gm, bw_compiler=no_backward))
    with pytest.warns(RuntimeWarning, match="no backward compiler"):
        got = _value_and_grad(compiled, logits, targets)
    torch.testing.assert_close(got, _value_and_grad(lm_loss, logits, targets), rtol=0, atol=0)
    assert compiled.failure is not None


def test_an_error_of_the_inputs_is_raised_as_the_loss_raises_it():
    logits, targets = _logits()
    targets[1, 1] = 1000  # out of the vocabulary
    compiled = CompiledLoss(lm_loss, devices=("cpu",), backend="eager")
    with pytest.raises(IndexError, match="out of bounds"):
        compiled(logits, targets)
    assert compiled.failure is None  # the compiler was not at fault: it stays on


def test_the_option_is_checked_and_drops_the_loss_from_the_compute_model():
    with pytest.raises(TypeError, match="pipeline_compile_loss must be True or False"):
        PipelineOptions(2, compile_loss="yes")
    with pytest.raises(ValueError, match="pipeline_compile_loss=True compiles the last pipeline stage's loss"):
        PipelineOptions(1, compile_loss=True)
    with pytest.raises(TypeError, match="needs a callable"):
        CompiledLoss("lm_loss")
    from distributed_training.models import GPT
    from distributed_training.pipeline.balance import layer_costs, split_step
    from distributed_training.pipeline.stages import chain

    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    model = GPT(cfg)
    layers = chain(model)
    for loss in (True, False):
        assert split_step(model, layers, "compute", [], loss=loss) == gpt_layer_costs(cfg, loss=loss)
        forward, backward = gpt_layer_costs(cfg, loss=loss)
        assert layer_costs(model, layers, "compute", loss=loss) == [f + b for f, b in zip(forward, backward)]
    assert gpt_layer_costs(cfg, loss=False)[0][-1] < gpt_layer_costs(cfg)[0][-1]
    assert GPTStages(cfg).step_costs(loss=False) == gpt_layer_costs(cfg, loss=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_on_cuda_equals_the_loss_as_it_is(dtype):
    """Inductor's fused loss on a GPU, bf16 logits as the head gives them under autocast: the loss and the
    logits' gradient as `lm_loss`'s, within float rounding (the fused reduction adds in another order);
    a second sequence length works too."""
    compiled = CompiledLoss(lm_loss)
    for length in (5, 9):
        g = torch.Generator().manual_seed(length)
        logits = torch.randn(4, length, 50257, generator=g).to("cuda", dtype).requires_grad_(True)
        targets = torch.randint(0, 50257, (4, length), generator=g).cuda()
        want, got = _value_and_grad(lm_loss, logits, targets), _value_and_grad(compiled, logits, targets)
        assert compiled.failure is None, compiled.failure
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-6)
