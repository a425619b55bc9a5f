"""Fake tensors refuse what the real step refuses, with the real error's words: a dtype the fake (meta) kernel
does not check, an index out of range that only the values show (positions made by torch.arange)."""

import pytest
import torch
from torch import nn

import memtorch
from memtorch.errors import MemtorchError


def _real_error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def _gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_int64_input_to_a_float_linear(device):
    model, x = nn.Linear(8, 4), torch.zeros(2, 8, dtype=torch.long)
    words = _real_error(lambda: model(x))  # RuntimeError: mat1 and mat2 must have the same dtype, ...
    with pytest.raises(MemtorchError, match="fails as the real one would") as info:
        memtorch.estimate(model, x, optimizer="sgd", device=device)
    assert words in str(info.value)
    with pytest.raises(MemtorchError) as info:  # a forward alone, too
        memtorch.estimate(model, x, training=False, device=device)
    assert words in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bf16_true_with_a_float32_input(device):
    x = torch.zeros(2, 8)
    words = _real_error(lambda: nn.Linear(8, 4).to(torch.bfloat16)(x))
    with pytest.raises(MemtorchError) as info:
        memtorch.estimate(nn.Linear(8, 4), x, precision="bf16-true", optimizer="sgd", device=device)
    assert words in str(info.value) and "pass them in bfloat16" in str(info.value)
    # the same step with bfloat16 inputs is estimated
    est = memtorch.estimate(nn.Linear(8, 4), x.to(torch.bfloat16), precision="bf16-true", optimizer="sgd",
                            device="cpu")  # fmt: skip
    assert est.model_states["parameter"] == 2 * (8 * 4 + 4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gpt2_sequence_longer_than_its_positions(device):
    model = _gpt2()
    ids = torch.zeros(2, 20, dtype=torch.long)  # 20 positions, the model has 16
    words = _real_error(lambda: model(ids))  # IndexError: index out of range in self
    with pytest.raises(MemtorchError) as info:
        memtorch.estimate(model, ids, optimizer="sgd", device=device)
    assert words in str(info.value)
    # 16 positions are estimated, and the values of the real ids never matter (zeros or not)
    ok = memtorch.estimate(model, torch.zeros(2, 16, dtype=torch.long), optimizer="sgd", device=device)
    assert ok.peak == memtorch.estimate(model, torch.full((2, 16), 99), optimizer="sgd", device=device).peak
