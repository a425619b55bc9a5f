"""Replayed blocks (memtorch/estimator/replay.py) against the full dry run, byte for byte.

Each family of the sweep, built six blocks deep, runs its dry run twice: with the identical blocks
replayed and with every block run. The two ledgers must be the same events (storages renamed by first
allocation; a run of consecutive frees compared as a set, since the order of frees with no allocation
between them changes no figure), the same per-module calls, and estimate() the same figures.
"""

import pytest
import torch
from torch import nn

import memtorch
from memtorch import _inputs
from memtorch.estimator import estimate as E
from memtorch.estimator import replay

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

B, S, L = 2, 16, 6


def _lm(cls, cfg_cls, **kw):
    def make():
        return getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw))

    def batch():
        ids = torch.randint(0, 128, (B, S))
        return {"input_ids": ids, "labels": ids.clone()}

    return make, batch


DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=128, max_position_embeddings=64)  # fmt: skip


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True, dropout=0.0)
        self.body = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x)).pow(2).mean()


FAMILIES = {
    # family: (make, batch, replays: whether its blocks are replayed; T5's take a second input that needs a
    # gradient, the position bias block 0 makes, so they run)
    "llama": (*_lm("LlamaForCausalLM", "LlamaConfig", **DEC), True),
    "gpt2": (*_lm("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=L, n_head=2, vocab_size=128, n_positions=64),
             True),
    "qwen2": (*_lm("Qwen2ForCausalLM", "Qwen2Config", **DEC), True),
    "gemma": (*_lm("GemmaForCausalLM", "GemmaConfig", **DEC, head_dim=8), True),
    "mixtral": (*_lm("MixtralForCausalLM", "MixtralConfig", **DEC, num_local_experts=4, num_experts_per_tok=2), True),
    "bert": (*_lm("BertForMaskedLM", "BertConfig", hidden_size=32, num_hidden_layers=L, num_attention_heads=2,
                  intermediate_size=64, vocab_size=128, max_position_embeddings=64), True),
    "t5": (*_lm("T5ForConditionalGeneration", "T5Config", d_model=32, d_ff=64, d_kv=8, num_layers=L, num_heads=4,
                vocab_size=128, decoder_start_token_id=0, pad_token_id=0), False),
    "mamba": (*_lm("MambaForCausalLM", "MambaConfig", hidden_size=32, state_size=8, num_hidden_layers=L,
                   vocab_size=128), True),
    "transformer_encoder": (_Encoder, lambda: (torch.randn(B, S, 32),), True),
}  # fmt: skip

SETTINGS = [
    ("fp32", "cpu", None),
    ("bf16-mixed", "cpu", "blocks"),
    ("bf16-mixed", "cuda", None),
    ("fp32", "cuda", "blocks"),
]


def _canon(ledger, hooks):
    names, out, run = {}, [], []
    for key, sign in ledger.events:
        names.setdefault(key, len(names))
        e = (sign, names[key], *ledger.info[key])
        if sign < 0:
            run.append(e)
            continue
        out += sorted(run, key=repr)
        run = []
        out.append(e)
    out += sorted(run, key=repr)
    return out, sorted(hooks.calls), hooks.spans


def _loss(out, *args, **kwargs):
    return out if isinstance(out, torch.Tensor) else out.loss


def _dry(model, batch, precision, device, checkpointing, on):
    inputs = _inputs.read(batch if isinstance(batch, tuple) else (batch,))
    gpu = E.resolve_gpu("h100") if device == "cuda" else None
    ledger, hooks, facts = E._dry_run(
        model, inputs, "adamw", _loss, precision, device, checkpointing, gpu=gpu, replay=on,
    )
    E._classify(ledger, hooks)
    return _canon(ledger, hooks), facts["replayed"]


# every family in every setting in the full pass; two in the sanitizer and -X dev passes
_QUICK = {("llama", "fp32", "cpu", None), ("bert", "bf16-mixed", "cuda", None)}


@pytest.mark.parametrize(
    "name,precision,device,checkpointing",
    [pytest.param(n, *st, marks=() if (n, *st) in _QUICK else pytest.mark.slow) for n in FAMILIES for st in SETTINGS],
)
def test_a_replayed_run_is_the_full_run(name, precision, device, checkpointing):
    make, batch, replays = FAMILIES[name]
    torch.manual_seed(0)
    model = make()
    b = batch()
    try:
        full, none = _dry(model, b, precision, device, checkpointing, False)
    except memtorch.MemtorchError as e:  # a setting the family refuses: nothing to compare
        pytest.skip(f"not estimated: {e}")
    assert none == 0
    try:
        got, replayed = _dry(model, b, precision, device, checkpointing, True)
    except replay.Mismatch as e:
        assert not replays, f"{name}: {e}"
        return
    assert got == full
    assert replayed == (2 * (L - 4) if replays else 0), f"{name}: {replayed} blocks replayed over two steps"


def test_estimate_gives_the_same_figures_with_and_without_replay(monkeypatch):
    make, batch, _ = FAMILIES["llama"]
    model, b = make(), batch()
    figures = []
    for on in (True, False):
        monkeypatch.setattr(replay, "ENABLED", on)
        for kw in ({"device": "cpu"}, {"gpu": "h100", "precision": "bf16-mixed", "world_size": 4, "sharding": "zero3"}):
            e = memtorch.estimate(model, b, optimizer="adamw", **kw)
            rows = [(m.name, m.calls, m.peak_above_start, m.activation_bytes) for m in e.modules]
            phases = {k: (p.peak, p.delta) for k, p in e.phases.items()}
            figures.append((e.peak, e.reserved_peak, e.breakdown, phases, rows, e.per_rank))
    assert figures[:2] == figures[2:]


class _Masked(nn.Module):
    """A block that takes a tensor of its own (a per-layer mask): its inputs are not block 1's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.lin(x) * mask


def test_a_block_whose_inputs_are_not_block_1s_runs():
    class Net(nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.blocks = nn.ModuleList([_Masked() for _ in range(6)])
            self.shared = shared

        def forward(self, x):
            one = torch.ones(16)
            masks = [one] * 6 if self.shared else [torch.ones(16) for _ in range(6)]
            for b, m in zip(self.blocks, masks):
                x = b(x, m)
            return x.sum()

    x = torch.randn(4, 16)
    for shared, replayed in ((True, 2 * (6 - 4)), (False, 0)):
        model = Net(shared)
        full, _ = _dry(model, (x,), "fp32", "cpu", None, False)
        got, n = _dry(model, (x,), "fp32", "cpu", None, True)
        assert (got, n) == (full, replayed)


def test_blocks_with_different_attributes_are_not_a_group():
    class Block(nn.Module):
        def __init__(self, sliding):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.sliding = sliding
            self.layer_idx = 0

    class Net(nn.Module):
        def __init__(self, flags):
            super().__init__()
            self.layers = nn.ModuleList([Block(f) for f in flags])

    same = Net([False] * 6)
    assert len(replay.groups(same, E._Hooks(None, same), torch)) == 1
    mixed = Net([False, True] * 3)
    assert replay.groups(mixed, E._Hooks(None, mixed), torch) == []
    short = Net([False] * 4)
    assert replay.groups(short, E._Hooks(None, short), torch) == []


def test_blocks_without_an_input_that_needs_a_gradient_run_once(monkeypatch):
    """Only the head trains: no block's input needs a gradient, so no block is replayed, and the step is
    dry-run once (not once with replay and again without)."""
    make, batch, _ = FAMILIES["llama"]
    model, b = make(), batch()
    for p in model.model.parameters():
        p.requires_grad_(False)
    runs = []
    real = E._dry_run

    def counted(*a, **k):
        runs.append(k.get("replay"))
        out = real(*a, **k)
        assert out[2]["replayed"] == 0
        return out

    monkeypatch.setattr(E, "_dry_run", counted)
    on = memtorch.estimate(model, b, optimizer="adamw", device="cpu")
    assert runs == [True]
    monkeypatch.setattr(replay, "ENABLED", False)
    off = memtorch.estimate(model, b, optimizer="adamw", device="cpu")
    assert (on.peak, on.breakdown) == (off.peak, off.breakdown)
