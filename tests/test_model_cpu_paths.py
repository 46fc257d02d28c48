"""The model's bf16-autocast and torch.compile paths, exercised on CPU so CI covers them without a GPU.

The end-to-end pretraining runs with impl.precision / impl.compile are tested with the training loop; here
only the model: a tiny crammed BERT (gated FFN, sparse prediction, padded rows) with the PyTorch backends.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cramming.model import IGNORE_INDEX, ArchConfig, BertForMLM, kernels_by_name

VOCAB, BATCH, SEQ = 64, 4, 32
TINY = ArchConfig(
    name="tiny", num_layers=2, hidden_size=64, num_heads=2, intermediate_size=256, max_seq_length=SEQ
)


def batch(gen: torch.Generator):
    """(input_ids, labels, attention_mask): 25% of the real positions masked, the last row half padding."""
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    lengths = torch.tensor([SEQ] * (BATCH - 1) + [SEQ // 2])
    attention_mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    masked = (torch.rand(BATCH, SEQ, generator=gen) < 0.25) & attention_mask
    masked[:, 0] = True
    return (
        torch.where(masked, 1, ids).masked_fill(~attention_mask, 0),
        torch.where(masked, ids, IGNORE_INDEX),
        attention_mask,
    )


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bf16_autocast_forward_backward_on_cpu(attention):
    torch.manual_seed(0)
    model = BertForMLM(TINY, VOCAB, dropout=0.0, kernels=kernels_by_name(attention=attention))
    twin = copy.deepcopy(model)
    inputs, labels, mask = batch(torch.Generator().manual_seed(0))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(inputs, labels, mask)
    out.loss.backward()
    reference = twin(inputs, labels, mask).loss  # fp32

    assert out.logits.dtype == torch.bfloat16, "autocast did not reach the decoder"
    assert out.loss.dtype == torch.float32, "the loss should be computed in fp32 from bf16 logits"
    # bf16 keeps 8 significant bits (relative rounding 2**-9 per op); a few dozen rounded ops deep, the
    # loss stays within a few percent of fp32, and a wrong cast (e.g. softmax in bf16 over -inf) is far off
    assert abs(out.loss.item() - reference.item()) < 0.03 * reference.item(), (
        f"bf16 loss {out.loss.item():.4f} vs fp32 {reference.item():.4f}"
    )
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name}: no gradient under autocast"
        assert param.grad.dtype == torch.float32, f"{name}: gradient in {param.grad.dtype}, not fp32"
        assert torch.isfinite(param.grad).all(), f"{name}: non-finite gradient under autocast"
        assert param.grad.abs().sum() > 0, f"{name}: zero gradient under autocast"


@pytest.mark.slow
def test_torch_compile_trains_on_cpu():
    """torch.compile (inductor, C++ on CPU) of the tiny model: a few steps, same losses as eager, falling."""
    torch.manual_seed(0)
    eager = BertForMLM(TINY, VOCAB, dropout=0.0, kernels=kernels_by_name(attention="sdpa"))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)

    def train(model, module, steps=8):
        optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        fixed = batch(gen)  # one batch, seen every step: the loss must fall
        losses = []
        for _ in range(steps):
            loss = model(*fixed).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    want, got = train(eager, eager), train(compiled, compiled_model)
    assert got[-1] < 0.8 * got[0], f"compiled model did not learn: {got}"
    # fp32 both ways; inductor fuses and reorders reductions, so equal up to accumulated rounding
    worst = max(range(len(want)), key=lambda i: abs(got[i] - want[i]))
    assert abs(got[worst] - want[worst]) < 1e-3 * want[worst], (
        f"compiled and eager part at step {worst}: {got[worst]:.6f} vs {want[worst]:.6f}"
    )
