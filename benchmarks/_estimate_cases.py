"""Models and steps shared by bench_estimate.py and tests/test_estimate.py (small, CPU)."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d, heads, dropout=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """GPT-style decoder with the output layer tied to the token embedding."""

    def __init__(self, vocab=1000, d=128, layers=2, heads=4, ctx=64, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def gpt_loss(logits, idx):
    return F.cross_entropy(logits.flatten(0, 1), idx.flatten())


def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(64, 128, 2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def frozen_backbone():
    backbone = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())
    for p in backbone.parameters():
        p.requires_grad_(False)
    return nn.Sequential(backbone, nn.Linear(1024, 10))


def dropout_mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(512, 10))  # fmt: skip


def tokens(batch=8, ctx=64, vocab=1000):
    return torch.randint(0, vocab, (batch, ctx))


# name -> (model factory, input factory, optimizer, loss or None, precision, checkpointing)
CASES = {
    "MLP, SGD": (mlp, lambda: torch.randn(64, 256), "sgd", None, "fp32", None),
    "MLP, SGD momentum": (mlp, lambda: torch.randn(64, 256), "sgd-momentum", None, "fp32", None),
    "MLP + dropout, Adam": (dropout_mlp, lambda: torch.randn(64, 256), "adam", None, "fp32", None),
    "CNN + BatchNorm, SGD momentum": (cnn, lambda: torch.randn(16, 3, 32, 32), "sgd-momentum", None, "fp32", None),
    "CNN + BatchNorm, AdamW, bf16 autocast": (cnn, lambda: torch.randn(16, 3, 32, 32), "adamw", None, "bf16-mixed", None),
    "LSTM, Adam": (LSTMNet, lambda: torch.randn(16, 50, 64), "adam", None, "fp32", None),
    "GPT tied, AdamW": (GPT, tokens, "adamw", gpt_loss, "fp32", None),
    "GPT tied, AdamW, checkpointing": (GPT, tokens, "adamw", gpt_loss, "fp32", "blocks"),
    "GPT tied + dropout, AdamW, bf16 autocast": (lambda: GPT(dropout=0.1), tokens, "adamw", gpt_loss, "bf16-mixed", None),
    "GPT tied, Adam, bf16 autocast, checkpointing": (GPT, tokens, "adam", gpt_loss, "bf16-mixed", "blocks"),
    "Frozen backbone + head, AdamW": (frozen_backbone, lambda: torch.randn(64, 256), "adamw", None, "fp32", None),
    # medium: kernel calls above the 32 MiB probe cap (their scratch space is not measured)
    "CNN + BatchNorm, batch 64 at 64x64, SGD momentum": (
        cnn, lambda: torch.randn(64, 3, 64, 64), "sgd-momentum", None, "fp32", None,
    ),  # fmt: skip
    "GPT tied d=512, 4 layers, 8x256 tokens, AdamW": (
        lambda: GPT(vocab=8000, d=512, layers=4, heads=8, ctx=256), lambda: tokens(8, 256, 8000), "adamw", gpt_loss,
        "fp32", None,
    ),  # fmt: skip
    "TransformerEncoder, AdamW": (
        lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True), 2),
        lambda: torch.randn(16, 64, 128), "adamw", None, "fp32", None,
    ),  # fmt: skip
}


def real_step(model, x, optimizer, loss_fn, precision, checkpoint_spec, steps=2):
    """The step estimate() models, run for real: forward, loss, backward, step, zero_grad; twice."""
    import contextlib

    import memtorch
    from memtorch.estimator.estimate import _make_optimizer, checkpointing, default_loss

    params = [p for p in model.parameters() if p.requires_grad]
    seen, uniq = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            uniq.append(p)
    opt = _make_optimizer(optimizer, uniq, "cpu")
    loss_fn = loss_fn or default_loss
    low = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    autocast = precision.endswith("-mixed")
    with checkpointing(model, checkpoint_spec), memtorch.track(model, optimizer=opt) as t:
        for _ in range(steps):
            ctx = torch.autocast("cpu", dtype=low) if autocast else contextlib.nullcontext()
            with ctx:
                out = model(x)
            with torch.autocast("cpu", dtype=low) if autocast else contextlib.nullcontext():
                loss = loss_fn(out, x)
            del out
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return t.report, opt


# --------------------------------------------------------------------------- Llama-style decoder
LLAMA_7B = dict(vocab=32000, d=4096, layers=32, heads=32, ffn=11008, ctx=4096)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (z(h).view(b, t, self.heads, -1).transpose(1, 2) for z in (self.q, self.k, self.v))
        q = q * cos + _rotate(q) * sin
        k = k * cos + _rotate(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A Llama-style decoder (RMSNorm, rotary positions, SwiGLU), built from a config."""

    def __init__(self, vocab, d, layers, heads, ffn, ctx):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(ctx).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.embed(idx)
        cos, sin = self.cos[:t], self.sin[:t]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
