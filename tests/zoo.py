"""The model zoo every test file may import: small functions returning fresh models.

Each builder is cheap (well under a second) unless its name says otherwise
(transformer_12 and synthetic_many are for the benchmark; build them on meta).
Hand counts of their bytes live in the tests, with their derivations.
"""

import warnings

import torch
from torch import nn

__all__ = [
    "SeedModel",
    "seed_model",
    "cnn_bn",
    "lstm",
    "tied_transformer",
    "frozen_backbone",
    "meta_model",
    "mixed_dtype",
    "sparse_case",
    "quantized_case",
    "multi_name_submodule",
    "view_buffer",
    "two_devices",
    "transformer_12",
    "synthetic_many",
    "scripted_seed",
    "traced_cnn",
    "partly_scripted",
    "ZOO",
]


class SeedModel(nn.Module):
    """The quickstart's model: 784 -> 128 -> 10 with ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def seed_model():
    return SeedModel()


def cnn_bn():
    """Conv + BatchNorm (running_mean, running_var, num_batches_tracked buffers)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def lstm():
    return nn.LSTM(input_size=16, hidden_size=32, num_layers=2)


class TiedTransformer(nn.Module):
    """Embedding and output layer share one weight (vocab x d_model)."""

    def __init__(self, vocab=100, d_model=32, nhead=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


def tied_transformer():
    return TiedTransformer()


def frozen_backbone():
    """A frozen backbone (requires_grad False) with a trainable head."""
    m = nn.Sequential()
    m.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))
    m.head = nn.Linear(64, 5)
    for p in m.backbone.parameters():
        p.requires_grad_(False)
    return m


def meta_model():
    """Built on the meta device: nothing allocated."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))


class MixedDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(10, dtype=torch.float32))
        self.b = nn.Parameter(torch.zeros(10, dtype=torch.float16))
        self.c = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
        self.d = nn.Parameter(torch.zeros(10, dtype=torch.complex64))
        self.register_buffer("e", torch.zeros(10, dtype=torch.int8))
        self.register_buffer("f", torch.zeros(10, dtype=torch.bool))
        if hasattr(torch, "float8_e4m3fn"):
            self.register_buffer("g", torch.zeros(10, dtype=torch.float8_e4m3fn))


def mixed_dtype():
    return MixedDtype()


class SparseCase(nn.Module):
    """A dense weight, a sparse COO buffer and a sparse CSR buffer."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))
        dense = torch.zeros(6, 6)
        dense[0, 1] = dense[2, 3] = dense[5, 5] = 1.0  # 3 non-zeros
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            self.register_buffer("coo", dense.to_sparse_coo().coalesce())
            self.register_buffer("csr", dense.to_sparse_csr())


def sparse_case():
    return SparseCase()


class QuantizedCase(nn.Module):
    """Buffers holding per-tensor (qint8) and per-channel (quint8) quantized tensors."""

    def __init__(self):
        super().__init__()
        x = torch.linspace(-1, 1, 16).reshape(4, 4)
        with warnings.catch_warnings():  # quantized creation functions are deprecated
            warnings.simplefilter("ignore", UserWarning)
            self.register_buffer("per_tensor", torch.quantize_per_tensor(x, 0.1, 0, torch.qint8))
            self.register_buffer(
                "per_channel",
                torch.quantize_per_channel(
                    x, torch.full((4,), 0.1, dtype=torch.float64), torch.zeros(4, dtype=torch.int64), 0, torch.quint8
                ),
            )


def quantized_case():
    return QuantizedCase()


def multi_name_submodule():
    """One Linear(8, 8) registered under two names."""
    m = nn.Module()
    shared = nn.Linear(8, 8)
    m.first = shared
    m.second = shared
    return m


class ViewBuffer(nn.Module):
    """A buffer that is a view (first row) of a parameter."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8))
        self.register_buffer("row0", self.weight.detach()[0])


def view_buffer():
    return ViewBuffer()


def two_devices():
    """Half on the CPU, half on meta (the only two devices every machine has)."""
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    m[1].to("meta")
    return m


def transformer_12(device="meta"):
    """12-layer nn.TransformerEncoder, BERT-base shapes (d_model 768, 12 heads, ff 3072)."""
    with torch.device(device):
        layer = nn.TransformerEncoderLayer(768, 12, dim_feedforward=3072, batch_first=True)
        return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)


def synthetic_many(n_tensors=50_000, device="meta"):
    """A model with n_tensors parameter tensors (n_tensors/2 Linear(8, 8))."""
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n_tensors // 2)])


# name -> builder, for parametrised tests (fast builders only).
def scripted_seed():
    """torch.jit.script of the seed model: its tables are C++ wrappers, not dicts."""
    return torch.jit.script(SeedModel())


def traced_cnn():
    """torch.jit.trace of cnn_bn (a traced module has no _parameters in its __dict__)."""
    model = cnn_bn().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(model, torch.randn(1, 3, 8, 8))


class PartlyScripted(nn.Module):
    """A plain module holding a scripted submodule beside a plain one."""

    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(16, 8)
        self.scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))

    def forward(self, x):
        return self.scripted(self.plain(x))


def partly_scripted():
    return PartlyScripted()


ZOO = {
    "scripted_seed": scripted_seed,
    "traced_cnn": traced_cnn,
    "partly_scripted": partly_scripted,
    "seed_model": seed_model,
    "cnn_bn": cnn_bn,
    "lstm": lstm,
    "tied_transformer": tied_transformer,
    "frozen_backbone": frozen_backbone,
    "meta_model": meta_model,
    "mixed_dtype": mixed_dtype,
    "sparse_case": sparse_case,
    "quantized_case": quantized_case,
    "multi_name_submodule": multi_name_submodule,
    "view_buffer": view_buffer,
    "two_devices": two_devices,
}
