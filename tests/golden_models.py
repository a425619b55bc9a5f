"""The models and steps of the golden files (tests/golden/*.txt, tests/test_golden.py).

Importable as a module (tests.golden_models is not a package: test_golden puts tests/ on the path)
and as a CLI TARGET by file path: `memtorch inspect tests/golden_models.py:gpt2_32`. Everything is
built from a fixed seed and a config (no download); figures depend only on shapes and dtypes.
"""

import torch
from torch import nn

SEQ = 32  # tokens per sample of the GPT-2 inputs
BATCH = 2


def mlp():
    """A 2-layer MLP: Linear(64, 128), ReLU, Linear(128, 10) (float32)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _gpt2(n_layer):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg)  # lm_head.weight is tied to transformer.wte.weight


def gpt2_32():
    """A tiny GPT-2 of 32 blocks (n_embd 64, vocabulary 256): the fold of a deep model, a tied weight."""
    return _gpt2(32)


def gpt2_2():
    """The same GPT-2 with 2 blocks: plan and advise run many dry runs."""
    return _gpt2(2)


def lm_batch():
    """{'input_ids', 'labels'}: BATCH x SEQ int64 (the CLI's --input input_ids=2x32:int64 --input labels=2x32:int64)."""
    # two tensors, as the CLI makes them (the same tensor twice would be one storage: half the input bytes)
    return {"input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long), "labels": torch.zeros(BATCH, SEQ, dtype=torch.long)}


LM_INPUT_FLAGS = ["--input", f"input_ids={BATCH}x{SEQ}:int64", "--input", f"labels={BATCH}x{SEQ}:int64"]


class Checkpointed(nn.Module):
    """Two blocks Linear(64, 64), ReLU, each run under torch.utils.checkpoint (non-reentrant: its
    activations recomputed in backward), then Linear(64, 10) (float32)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def mlp_checkpointed():
    """Checkpointed(), from a fixed seed."""
    torch.manual_seed(0)
    return Checkpointed()
