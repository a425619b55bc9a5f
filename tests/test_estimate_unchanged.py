"""estimate() never changes the program it estimates: every parameter, buffer and gradient of the model,
and the optimizer's state, hold the same values (and the same tensors) after a dry run, on the CPU and on
cuda, training, inference and generation. (A dry run that ran an operator for real on a real tensor once
rewrote a GPT-2's parameters in place.)"""

import pytest
import torch
from torch import nn

import memtorch


def _snapshot(model, opt=None):
    out = {}
    for n, p in model.named_parameters():
        out[n] = (p.data_ptr(), p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
    for n, b in model.named_buffers():
        out["buffer " + n] = (b.data_ptr(), b.detach().clone(), None)
    if opt is not None:
        for i, st in enumerate(opt.state.values()):
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"state {i} {k}"] = (v.data_ptr(), v.detach().clone(), None)
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        (pa, va, ga), (pb, vb, gb) = a[k], b[k]
        assert pa == pb, k
        assert torch.equal(va, vb), f"{k} changed"
        assert (ga is None) == (gb is None) and (ga is None or torch.equal(ga, gb)), f"{k}.grad changed"


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_training_estimate_leaves_the_model_and_optimizer_as_they_were(device):
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # gradients and state exist
    before = _snapshot(model, opt)
    memtorch.estimate(model, torch.randn(8, 16), optimizer=opt, device=device)
    _same(before, _snapshot(model, opt))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("training, new", [(True, None), (False, None), (False, 4)])
def test_gpt2_estimates_leave_it_as_it_was(device, training, new):
    model = _gpt2()
    if not training:
        model.eval()
    ids = torch.zeros(2, 8, dtype=torch.long)
    before = _snapshot(model)
    kw = {"input_ids": ids} if new else {"input_ids": ids, "labels": ids}
    memtorch.estimate(model, kw, device=device, training=training, max_new_tokens=new)
    _same(before, _snapshot(model))
