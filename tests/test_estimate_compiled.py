"""estimate() of a compiled model (torch.compile(model), a compiled submodule, module.compile()): the eager
program's figures, and a note that says so."""

import torch
from torch import nn

import memtorch


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def test_compiled_model_is_estimated_as_the_eager_program_and_says_so():
    eager = memtorch.estimate(_mlp(), (8, 64), device="cpu")
    part = _mlp()
    part[0] = torch.compile(part[0])
    in_place = _mlp()
    in_place.compile()
    for model, names in ((torch.compile(_mlp()), "(model)"), (part, "0"), (in_place, "(model)")):
        est = memtorch.estimate(model, (8, 64), device="cpu")
        assert est.peak == eager.peak and est.breakdown == eager.breakdown  # the eager step's figures
        note = [n for n in est.notes if "compiled" in n]
        assert len(note) == 1 and f"torch.compile: {names})" in note[0] and "eager program" in note[0]
        assert "eager program" in str(est)
    assert not any("compiled" in n for n in eager.notes)
