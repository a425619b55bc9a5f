"""Models after torchinfo's test fixtures and small `transformers` families, each held
against an independent unique-storage count.

The torchinfo-style models are written here after reading what torchinfo's
fixtures (tests/fixtures/models.py) exercise: an LSTM net, a layer reused
under several names, Siamese nets, partly scripted models, parameters that
are splits of one storage, a ModuleList holding None, plain tensor
attributes, uninitialized parameters, a 0-d tensor attribute, a model on two
devices, names that look pruned... Their code is not copied. The
transformers models are built from tiny configs: no download.

The independent count is {storage._cdata: storage.nbytes()} over
model.parameters() and model.buffers() (torch's own view of what the model
holds), plus, for pruned models, the computed attribute.
"""

import warnings

import pytest
import torch
import torch.nn.utils.prune
from torch import nn

import memtorch
from memtorch import _reference

import zoo


def _initialized(tensors):
    # A LazyModule's UninitializedParameter holds no memory yet (and refuses
    # untyped_storage()).
    return [t for t in tensors if not isinstance(t, nn.parameter.UninitializedTensorMixin)]


def independent(model, extra=()):
    seen = {}
    for t in _initialized(list(model.parameters()) + list(model.buffers()) + list(extra)):
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(500, 30)
        self.encoder = nn.LSTM(30, 20, num_layers=2, batch_first=True)
        self.decoder = nn.Linear(20, 500)


class SingleInputNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(0.3)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)


class RecursiveNet(nn.Module):
    """One conv registered once, applied several times in forward."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(64, 64, 3, 1, 1)


class SiameseNets(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 64, 10)
        self.conv2 = nn.Conv2d(64, 128, 7)
        self.fc1 = nn.Linear(256, 64)
        self.fc2 = nn.Linear(64, 1)
        self.dropout = nn.Dropout(0.5)


class ContainerModule(nn.Module):
    def __init__(self):
        super().__init__()
        self._layers = nn.ModuleList([nn.Linear(5, 5), nn.ModuleList([nn.Linear(5, 5), nn.ReLU()])])
        self.dict = nn.ModuleDict({"a": nn.Linear(5, 3), "b": nn.Sequential(nn.Linear(3, 3))})


class ParameterListModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(10, 10)) for _ in range(3)])
        self.pdict = nn.ParameterDict({"x": nn.Parameter(torch.randn(4)), "y": nn.Parameter(torch.randn(2, 2))})


class MixedTrainable(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(10), requires_grad=True)
        self.b = nn.Parameter(torch.randn(10), requires_grad=False)


class ReuseReLU(nn.Module):
    def __init__(self):
        super().__init__()
        relu = nn.ReLU()
        self.seq = nn.Sequential(nn.Linear(4, 4), relu, nn.Linear(4, 4), relu)


class EmptyModule(nn.Module):
    pass


class CustomParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("scale", torch.ones(4))


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(16, 3, 2, stride=2), nn.Sigmoid())


class PartialJIT(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.jit.script(nn.Conv2d(1, 4, 3))
        self.fc = nn.Linear(16, 2)


class Uninitialized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lazy = nn.LazyLinear(4)
        self.fc = nn.Linear(4, 4)


class PlainTensorAttrs(nn.Module):
    """No layers; its tensors are plain attributes (torchinfo's EmptyModule idea)."""

    def __init__(self):
        super().__init__()
        self.parameter = torch.rand(3, 3, requires_grad=True)  # 36 B, not registered
        self.example_input_array = torch.zeros(1, 2, 3, 4, 5)  # 480 B


class SplitParameters(nn.Module):
    """Parameters that are views (splits) of one storage."""

    def __init__(self):
        super().__init__()
        whole = torch.empty(100, 300)
        self.weights = nn.ParameterList([nn.Parameter(w) for w in whole.split([100, 200], dim=1)])


class ListWithNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))])
        self.layers.append(None)


class Choices(nn.Module):
    def __init__(self):
        super().__init__()
        self.choices = nn.ModuleDict({"conv": nn.Conv2d(4, 4, 3), "pool": nn.MaxPool2d(3)})
        self.acts = nn.ModuleDict({"lrelu": nn.LeakyReLU(), "prelu": nn.PReLU()})


class BareUninitialized(nn.Module):
    def __init__(self):
        super().__init__()
        self.param = nn.UninitializedParameter()


class ReuseLinear(nn.Module):
    """One Linear registered under four names inside a Sequential."""

    def __init__(self):
        super().__init__()
        lin = nn.Linear(10, 10)
        self.model = nn.Sequential(*[m for _ in range(4) for m in (lin, nn.ReLU())])


class SequentialWithParameter(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(4, 4), nn.Linear(4, 4))
        self.register_parameter("weights", nn.Parameter(torch.zeros(2)))


class Nested(nn.Module):
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(1, 1)
            self.p = nn.Parameter(torch.ones(1))

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 1)
        self.p = nn.Parameter(torch.ones(2))
        self.inner = Nested.Inner()


class Dilated(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 5, padding="same")
        self.blocks = nn.ModuleDict()
        for i in range(1, 4):
            self.blocks[f"conv{i}"] = nn.Conv2d(8, 8, 3, padding="same", dilation=2**i)
            self.blocks[f"bn{i}"] = nn.BatchNorm2d(8)


class TwoDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.net2 = nn.Linear(10, 5, device="meta")


class TensorKernelSize(nn.Module):
    """A 0-d tensor held as a plain attribute (as some HF conv wrappers do)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 1, kernel_size=3, padding=1)
        self.kernel_size = torch.tensor(3)


class CellRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 2)
        self.proj = nn.Linear(2, 3)


class FakePruned(nn.Module):
    """Parameters named like pruning's, without pruning."""

    def __init__(self):
        super().__init__()
        self.weight_orig = nn.Parameter(torch.ones(4, 6))
        self.weight_mask = nn.Parameter(torch.zeros(4, 6))


def pruned():
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)
    return model


def multihead():
    return nn.MultiheadAttention(16, 4)


TORCHINFO_LIKE = {
    "lstm_net": LSTMNet,
    "single_input": SingleInputNet,
    "recursive": RecursiveNet,
    "siamese": SiameseNets,
    "container": ContainerModule,
    "parameter_list": ParameterListModel,
    "mixed_trainable": MixedTrainable,
    "reuse_relu": ReuseReLU,
    "empty": EmptyModule,
    "custom_parameter": CustomParameter,
    "autoencoder": AutoEncoder,
    "partial_jit": PartialJIT,
    "uninitialized": Uninitialized,
    "pruned": pruned,
    "multihead": multihead,
    "plain_tensor_attrs": PlainTensorAttrs,
    "split_parameters": SplitParameters,
    "list_with_none": ListWithNone,
    "choices": Choices,
    "bare_uninitialized": BareUninitialized,
    "reuse_linear": ReuseLinear,
    "sequential_with_parameter": SequentialWithParameter,
    "nested": Nested,
    "dilated": Dilated,
    "two_devices": TwoDevices,
    "tensor_kernel_size": TensorKernelSize,
    "cell_rnn": CellRNN,
    "fake_pruned": FakePruned,
    "scripted_seed": zoo.scripted_seed,
    "traced_cnn": zoo.traced_cnn,
    "partly_scripted": zoo.partly_scripted,
}


def _extra(model):
    """Tensors a pruned model holds as plain attributes (the computed weight)."""
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(TORCHINFO_LIKE))
def test_torchinfo_like_models(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TORCHINFO_LIKE[name]()
    mm = memtorch.inspect(model)
    assert mm.total == independent(model, _extra(model))
    assert mm.numel == sum(p.numel() for p in _initialized(model.parameters()))
    assert _reference.inspect(model).total == mm.total
    assert sum(m.own for m in mm.modules) + mm.outside_modules == mm.total


def test_hand_counts_of_some():
    # 3x3 float32 + 1*2*3*4*5 float32, both plain attributes
    assert memtorch.inspect(PlainTensorAttrs()).by_category == {"attribute": 36 + 480}
    mm = memtorch.inspect(SplitParameters())
    assert (mm.total, mm.numel) == (100 * 300 * 4, 30_000)  # one storage, every element once
    assert memtorch.inspect(ReuseLinear()).total == 400 + 40
    # conv weight 3 + bias 1 float32; the int64 0-d kernel_size attribute
    assert memtorch.inspect(TensorKernelSize()).by_category == {"parameter": 16, "attribute": 8}
    assert memtorch.inspect(BareUninitialized()).total == 0


def test_pruned_weight_is_an_attribute():
    mm = memtorch.inspect(pruned())
    # weight_orig 40,000 + bias 400 + second Linear 4,000 + 40; mask 40,000; computed weight 40,000
    assert mm.by_category == {"parameter": 44_440, "buffer": 40_000, "attribute": 40_000}


# ---------------------------------------------------------------- transformers
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[zoo]')")


def _tiny(family):
    t = transformers
    if family == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64))
    if family == "bert":
        return t.BertModel(
            t.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)
        )
    if family == "llama":
        return t.LlamaForCausalLM(
            t.LlamaConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=64,
                vocab_size=100,
                tie_word_embeddings=True,
            )
        )
    if family == "t5":
        return t.T5ForConditionalGeneration(
            t.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=2, vocab_size=100)
        )
    raise ValueError(family)


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama", "t5"])
def test_transformers_families(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _tiny(family)
    mm = memtorch.inspect(model)
    assert mm.by_category.get("parameter", 0) + mm.by_category.get("buffer", 0) == independent(model)
    assert mm.total == independent(model, _extra(model))
    assert mm.numel == sum(p.numel() for p in model.parameters())
    assert sum(m.own for m in mm.modules) == mm.total
