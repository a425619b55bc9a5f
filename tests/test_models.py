"""memtorch.load_model / example_inputs (memtorch/models.py) and the CLI's model TARGETs.

Expected figures come from models built by hand with transformers and peft from the same config
files (tests/data/configs/<family>/config.json), from track() around their real steps on the CPU,
and from hand counts of the LoRA adapters. No network: HF_HUB_OFFLINE is set for every test, the
Hub cache is tests/data/hub (models--memtorch-tests--tiny-llama, a snapshot and refs/main), and a
download, where a test lets one happen, is a stand-in.
"""

import gc
import io
import json
import pathlib
import shutil
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import memtorch
from memtorch import cli, cpu, models
from memtorch.errors import MemtorchError

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[zoo]')"
)
try:
    import peft
except ImportError:
    peft = None
needs_peft = pytest.mark.skipif(peft is None, reason="peft is not installed (pip install -e '.[finetune]')")

DATA = pathlib.Path(__file__).resolve().parent / "data"
CONFIGS = DATA / "configs"
HUB = DATA / "hub"
LLAMA = CONFIGS / "llama"
FAMILIES = ["llama", "mistral", "gpt2", "bert", "t5", "vit", "whisper"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test reaches the network: offline, the repo's Hub cache, and hf_hub_download refused."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(HUB))
    monkeypatch.delenv("HF_HOME", raising=False)
    huggingface_hub = pytest.importorskip("huggingface_hub")

    def refused(*args, **kwargs):
        raise AssertionError(f"hf_hub_download{args} was called in a test")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    transformers.logging.set_verbosity_error()


def _seq(family):
    return None if family == "vit" else 16


def _by_hand(path, dtype=None):
    """The model transformers builds from the config, with real (random) weights on the CPU."""
    config = transformers.AutoConfig.from_pretrained(str(path))
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config)
    return model.train() if dtype is None else model.to(dtype).train()


def _unique_bytes(tensors):
    """torch's own count: each storage once."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _real_step_peak(make, batch, seq, steps=2):
    """track()'s peak of `steps` real AdamW steps over the trainable parameters, counted from before the
    model and its batch exist (as estimate() counts them): (bytes, model, batch)."""
    gc.collect()
    cpu.start()
    base = cpu.allocated()
    model = make()
    inputs = models.example_inputs(model, batch, seq, device="cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    with memtorch.track() as t:
        for _ in range(steps):
            out = model(**inputs)
            loss = out.loss
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = None
    assert t.report.exact
    return t.report.peak - base, model, inputs


# ---------------------------------------------------------------- a model from its config


@pytest.mark.parametrize("family", FAMILIES)
def test_built_from_a_config_as_transformers_builds_it(family):
    meta = models.load_model(CONFIGS / family)
    real = _by_hand(CONFIGS / family)
    assert type(meta) is type(real) and meta.training
    assert all(
        t.device.type == "meta" for t in list(meta.parameters()) + list(meta.buffers())
    )  # no weights read
    got = [(n, p.shape, p.dtype, p.requires_grad) for n, p in meta.named_parameters()]
    assert got == [(n, p.shape, p.dtype, p.requires_grad) for n, p in real.named_parameters()]
    assert _unique_bytes(meta.parameters()) == _unique_bytes(real.parameters())
    assert memtorch.inspect(meta).total == _unique_bytes(list(real.parameters()) + list(real.buffers()))
    # the estimate of the meta model is the estimate of the real one, input for input
    est_meta = memtorch.estimate(meta, models.example_inputs(meta, 2, _seq(family)), device="cpu")
    est_real = memtorch.estimate(
        real, models.example_inputs(real, 2, _seq(family), device="cpu"), device="cpu"
    )
    assert est_meta.peak == est_real.peak and est_meta.model_states == est_real.model_states


@pytest.mark.parametrize("family", ["llama", "t5", "vit"])
def test_the_estimate_of_a_config_is_the_real_steps_peak(family):
    """estimate(load_model(config)) against track() of two real steps of the model transformers builds
    from it (no dropout in these configs' paths that draws from the CPU generator: to the byte)."""
    seq = _seq(family)
    measured, real, _ = _real_step_peak(lambda: _by_hand(CONFIGS / family), 2, seq)
    meta = models.load_model(CONFIGS / family)
    est = memtorch.estimate(meta, models.example_inputs(meta, 2, seq), device="cpu", optimizer="adamw")
    assert est.peak == measured, (est.peak, measured)
    n = sum(p.numel() for p in real.parameters())
    assert est.model_states["parameter"] == est.model_states["gradient"] == 4 * n


def test_gpt2_with_dropout_within_a_tenth_of_a_percent():
    """GPT-2 draws dropout masks: the CPU generator's scratch makes a few bytes of difference."""
    measured, _, _ = _real_step_peak(lambda: _by_hand(CONFIGS / "gpt2"), 2, 16)
    meta = models.load_model(CONFIGS / "gpt2")
    est = memtorch.estimate(meta, models.example_inputs(meta, 2, 16), device="cpu")
    assert abs(est.peak - measured) <= 0.001 * measured


def test_the_package_names():
    assert memtorch.load_model is models.load_model and memtorch.example_inputs is models.example_inputs
    assert {"load_model", "example_inputs"} <= set(memtorch.__all__)


def test_a_config_file_a_directory_and_a_dtype():
    a = models.load_model(LLAMA / "config.json")
    b = models.load_model(str(LLAMA))
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    half = models.load_model(LLAMA, dtype="bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert _unique_bytes(half.parameters()) * 2 == _unique_bytes(a.parameters())
    base = models.load_model(LLAMA, task="base")
    assert type(base).__name__ == "LlamaModel"
    assert models.example_inputs(base, 1, 8).keys() == {"input_ids"}  # no head: no labels


def test_the_config_names_the_dtype(tmp_path):
    """dtype=None builds as transformers builds from the config: in the dtype the config names."""
    config = json.loads((LLAMA / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert {p.dtype for p in models.load_model(tmp_path).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in models.load_model(tmp_path, dtype=torch.float32).parameters()} == {torch.float32}


# ---------------------------------------------------------------- a model id, offline


def test_a_model_id_from_the_local_cache():
    model = models.load_model("memtorch-tests/tiny-llama")
    by_path = models.load_model(LLAMA)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [
        (n, p.shape) for n, p in by_path.named_parameters()
    ]


def test_hf_home_is_read_at_the_call(tmp_path, monkeypatch):
    shutil.copytree(HUB, tmp_path / "hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert models.hub_cache() == str(tmp_path / "hub")
    assert type(models.load_model("memtorch-tests/tiny-llama")).__name__ == "LlamaForCausalLM"


def test_a_missing_id_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(MemtorchError) as e:
        models.load_model("memtorch-tests/not-there")
    text = str(e.value)
    assert "'memtorch-tests/not-there'" in text and str(tmp_path) in text
    assert "HF_HUB_OFFLINE" in text and "config.json" in text
    assert "timm" in text


def test_online_only_config_json_is_fetched(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs.get("cache_dir")))
        path = tmp_path / "fetched" / filename
        path.parent.mkdir(exist_ok=True)
        shutil.copy(LLAMA / "config.json", path)
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    model = models.load_model("someone/tiny")
    assert calls == [("someone/tiny", "config.json", str(tmp_path))]
    assert type(model).__name__ == "LlamaForCausalLM"

    def fails(repo_id, filename, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fails)
    with pytest.raises(MemtorchError, match="downloading its config.json failed: OSError: Name or service"):
        models.load_model("someone/else")


# ---------------------------------------------------------------- timm


class _FakeTimm(types.ModuleType):
    """timm's two calls load_model makes (is_model, create_model); timm itself cannot be installed here."""

    def __init__(self):
        super().__init__("timm")
        self.calls = []

    def is_model(self, name):
        return name == "tiny_cnn"

    def create_model(self, name, pretrained=True, num_classes=5):
        self.calls.append((name, pretrained, torch.empty(0).device.type))
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
        )
        model.pretrained_cfg = {"input_size": (3, 32, 32)}
        return model


def test_a_timm_name(monkeypatch):
    fake = _FakeTimm()
    monkeypatch.setitem(sys.modules, "timm", fake)
    model = models.load_model("tiny_cnn")
    assert fake.calls == [("tiny_cnn", False, "meta")]  # no pretrained weights, built on the meta device
    assert {p.device.type for p in model.parameters()} == {"meta"}
    x = models.example_inputs(model, 4)
    assert isinstance(x, torch.Tensor) and x.shape == (4, 3, 32, 32) and x.device.type == "meta"
    est = memtorch.estimate(model, x, device="cpu", optimizer="sgd")
    assert est.model_states["parameter"] == (8 * 3 * 3 * 3 + 8 + 8 * 5 + 5) * 4  # by hand
    with pytest.raises(MemtorchError, match="an image model takes no seq"):
        models.example_inputs(model, 4, 16)


def test_a_timm_config_from_the_hub(monkeypatch, tmp_path):
    """A timm/... repository's config.json names the architecture, its classes and its input size."""
    config = {"architecture": "tiny_cnn", "num_classes": 7, "pretrained_cfg": {"input_size": [3, 48, 48]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    fake = _FakeTimm()
    monkeypatch.setitem(sys.modules, "timm", fake)
    model = models.load_model(tmp_path)
    assert fake.calls == [("tiny_cnn", False, "meta")] and model[-1].out_features == 7
    assert models.example_inputs(model, 2).shape == (2, 3, 48, 48)
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(MemtorchError, match=r"is a timm model's config \(tiny_cnn\): timm is not installed"):
        models.load_model(tmp_path)


def test_timm_missing_or_broken_is_said(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(
        MemtorchError, match=r"not a timm model name: timm is not installed \(pip install timm\)"
    ):
        models.load_model("resnet50")

    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "timm":
                raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.delitem(sys.modules, "timm")
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(MemtorchError, match="importing timm failed: RuntimeError: operator torchvision::nms"):
        models.load_model("resnet50")


# ---------------------------------------------------------------- example inputs


def test_example_inputs_by_family():
    assert {
        k: (v.shape, v.dtype) for k, v in models.example_inputs(models.load_model(LLAMA), 3, 10).items()
    } == {
        "input_ids": ((3, 10), torch.int64),
        "labels": ((3, 10), torch.int64),
    }
    vit = models.load_model(CONFIGS / "vit")
    batch = models.example_inputs(vit, 2)
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and batch["labels"].shape == (2,)  # config's sizes
    whisper = models.load_model(CONFIGS / "whisper")
    batch = models.example_inputs(whisper, 2, 12)
    # 16 mel bins, 2 frames per encoder position (32 of them), labels of the decoder's length
    assert batch["input_features"].shape == (2, 16, 64) and batch["labels"].shape == (2, 12)
    ids = models.example_inputs(models.load_model(LLAMA), 2, 8, device="cpu")
    assert (
        ids["input_ids"] is not ids["labels"] and ids["labels"].device.type == "cpu"
    )  # two tensors, as a collator


def test_example_inputs_refusals():
    with pytest.raises(MemtorchError, match="seq 300 is longer than the model's 256 learned positions"):
        models.example_inputs(models.load_model(CONFIGS / "gpt2"), 1, 300)
    with pytest.raises(MemtorchError, match="a text model needs seq"):
        models.example_inputs(models.load_model(LLAMA), 1)
    with pytest.raises(MemtorchError, match="an image model takes no seq"):
        models.example_inputs(models.load_model(CONFIGS / "vit"), 1, 8)
    with pytest.raises(MemtorchError, match="seq 65 is longer than the decoder's 64 positions"):
        models.example_inputs(models.load_model(CONFIGS / "whisper"), 1, 65)
    with pytest.raises(MemtorchError, match="not a Hugging Face or timm model"):
        models.example_inputs(nn.Linear(2, 2), 1)
    with pytest.raises(MemtorchError, match="batch must be a positive int"):
        models.example_inputs(models.load_model(LLAMA), 0, 8)


def test_load_model_refusals(tmp_path):
    with pytest.raises(MemtorchError, match="a directory with no config.json"):
        models.load_model(tmp_path)
    config = json.loads((LLAMA / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MemtorchError, match="names no architectures .*pass task="):
        models.load_model(tmp_path)
    assert type(models.load_model(tmp_path, task="causal-lm")).__name__ == "LlamaForCausalLM"
    with pytest.raises(MemtorchError, match="task='chat'"):
        models.load_model(tmp_path, task="chat")
    with pytest.raises(MemtorchError, match="floating-point dtype"):
        models.load_model(LLAMA, dtype="int64")
    with pytest.raises(MemtorchError, match="takes a model id"):
        models.load_model(nn.Linear(2, 2))


@needs_peft
def test_quantize_goes_to_memtorch_quantize(monkeypatch):
    """load_model(quantize=) hands the built model to memtorch._quantize.apply, before LoRA."""
    import memtorch._quantize

    seen = []

    def apply(model, quantize, *, double_quant=False, compute_dtype=None):
        seen.append((type(model).__name__, quantize, double_quant, compute_dtype))
        return model

    monkeypatch.setattr(memtorch._quantize, "apply", apply)
    model = models.load_model(
        LLAMA, quantize="nf4", double_quant=True, compute_dtype=torch.bfloat16, lora="r=2"
    )
    assert seen == [("LlamaForCausalLM", "nf4", True, torch.bfloat16)]
    assert type(model).__name__ == "PeftModelForCausalLM"


# ---------------------------------------------------------------- LoRA

# r=8 on q_proj (64 -> 64) and v_proj (64 -> 2 key-value heads x 16 = 32) of 2 layers: A is r x in, B is out x r
ADAPTER_NUMEL = 2 * (8 * (64 + 64) + 8 * (64 + 32))  # 3,584


def _peft_by_hand(dropout):
    model = _by_hand(LLAMA)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=dropout,
                             task_type="CAUSAL_LM")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers 5 a deprecated question
        return peft.get_peft_model(model, config)


@needs_peft
def test_lora_spellings():
    text = models.lora_config("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05")
    assert (text.r, text.lora_alpha, set(text.target_modules), text.lora_dropout) == (
        16,
        32,
        {"q_proj", "v_proj"},
        0.05,
    )
    given = {"r": 16, "lora_alpha": 32, "targets": ["q_proj", "v_proj"], "dropout": 0.05}
    d = models.lora_config(given)
    assert (d.r, d.lora_alpha, set(d.target_modules), d.lora_dropout) == (16, 32, {"q_proj", "v_proj"}, 0.05)
    assert models.lora_config("r=4,targets=all-linear").target_modules == "all-linear"
    for bad, match in [
        ("r=0", "r .the rank. is a positive int"),
        ("rank=8", "unknown key 'rank'"),
        ("r=8,q_proj", "'q_proj' is not KEY=VALUE"),
        ("r=8,dropout=1.5", r"dropout is a probability in \[0, 1\)"),
        ("r=8,r=4", "r is given twice"),
        ("", "sets nothing"),
    ]:
        with pytest.raises(MemtorchError, match=match):
            models.lora_config(bad)
    with pytest.raises(MemtorchError, match="lora= takes a string, a dict or a peft.LoraConfig"):
        models.lora_config(8)


@needs_peft
def test_lora_targets_not_in_the_model_say_which_are():
    with pytest.raises(
        MemtorchError, match=r"its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj"
    ):
        models.load_model(LLAMA, lora="r=8,targets=query,value")


@needs_peft
def test_a_users_lora_config_is_left_as_given():
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    before = config.to_dict()
    model = models.load_model(LLAMA, lora=config)
    assert type(model).__name__ == "PeftModelForCausalLM"  # the task type of its head, on a copy
    assert config.to_dict() == before and config.task_type is None


@needs_peft
def test_only_the_adapters_train():
    model = models.load_model(LLAMA, lora="r=8,targets=q_proj,v_proj")
    base = _unique_bytes(_by_hand(LLAMA).parameters())
    est = memtorch.estimate(model, models.example_inputs(model, 2, 16), device="cpu", optimizer="adamw")
    assert est.model_states["parameter"] == base + 4 * ADAPTER_NUMEL
    assert est.model_states["gradient"] == 4 * ADAPTER_NUMEL  # 14,336 B: the adapters' only
    # AdamW: exp_avg and exp_avg_sq per adapter element, a float32 step per adapter tensor (2 x 2 x 2)
    assert est.model_states["optimizer_state"] == 8 * ADAPTER_NUMEL + 4 * 8


@needs_peft
@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_a_lora_estimate_is_the_real_peft_steps_peak(dropout):
    _peft_by_hand(dropout)  # the process's first get_peft_model keeps 128 B of its own (not the model's)
    measured, real, _ = _real_step_peak(lambda: _peft_by_hand(dropout), 2, 64)
    assert sum(p.numel() for p in real.parameters() if p.requires_grad) == ADAPTER_NUMEL
    model = models.load_model(LLAMA, lora=f"r=8,alpha=16,targets=q_proj,v_proj,dropout={dropout}")
    est = memtorch.estimate(model, models.example_inputs(model, 2, 64), device="cpu", optimizer="adamw")
    # to the byte: each adapter's output is scaled by a Python number, which autograd keeps (8 B each)
    assert est.peak == measured, (est.peak, measured)


@needs_peft
def test_a_users_peft_model_is_estimated_as_it_is():
    user = _peft_by_hand(0.05)
    params = [(n, p, p.requires_grad, p.device) for n, p in user.named_parameters()]
    kinds = [(n, type(m)) for n, m in user.named_modules()]
    est = memtorch.estimate(user, models.example_inputs(user, 2, 16), device="cpu")
    assert [(n, p, p.requires_grad, p.device) for n, p in user.named_parameters()] == params
    assert [(n, type(m)) for n, m in user.named_modules()] == kinds and user.training
    assert all(p.grad is None for p in user.parameters())
    ours = models.load_model(LLAMA, lora="r=8,alpha=16,targets=q_proj,v_proj,dropout=0.05")
    again = memtorch.estimate(ours, models.example_inputs(ours, 2, 16), device="cpu")
    assert est.peak == again.peak and est.model_states == again.model_states


@needs_peft
def test_qlora_the_adapters_over_4bit_layers():
    """quantize= then lora=: peft's adapters sit on bitsandbytes' Linear4bit, and only they train."""
    pytest.importorskip("bitsandbytes")
    model = models.load_model(
        LLAMA, quantize="nf4", lora="r=8,targets=q_proj,v_proj", compute_dtype=torch.float32
    )
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q.base_layer).__name__ == "Linear4bit" and {p.device.type for p in model.parameters()} == {
        "meta"
    }
    est = memtorch.estimate(model, models.example_inputs(model, 2, 16), device="cpu")
    assert est.model_states["gradient"] == 4 * ADAPTER_NUMEL


def test_peft_missing_is_said(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MemtorchError, match=r"lora= needs peft \(pip install 'memtorch-probe\[finetune\]'\)"):
        models.load_model(LLAMA, lora="r=8")


# ---------------------------------------------------------------- the command line


def run(*argv):
    """(exit code, stdout text) of the command line in this process."""
    out = io.StringIO()
    code = cli.main([str(a) for a in argv], out=out)
    return code, out.getvalue()


@needs_peft
def test_cli_estimate_of_a_config_with_lora_is_true(capsys):
    code, text = run("estimate", LLAMA, "--batch", 2, "--seq", 64, "--lora", "r=8,targets=q_proj,v_proj",
                     "--device", "cpu", "--format", "json")  # fmt: skip
    assert code == 0, capsys.readouterr().err
    data = json.loads(text)
    assert data["model_states"]["gradient"] == 4 * ADAPTER_NUMEL

    # peft's default alpha is 8 and its default dropout 0: the same adapters as r=8,alpha=8 by hand
    def make():
        model = _by_hand(LLAMA)
        config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(model, config)

    measured, _, _ = _real_step_peak(make, 2, 64)
    assert abs(data["peak"] - measured) <= 0.001 * measured, (data["peak"], measured)
    code, text = run("estimate", LLAMA, "--batch", 2, "--seq", 64, "--lora", "r=8,targets=q_proj,v_proj",
                     "--device", "cpu")  # fmt: skip
    assert code == 0 and "PeftModelForCausalLM" in text and "memtorch.estimate on cpu" in text


def test_cli_inference_builds_the_model_in_evaluation_mode(monkeypatch):
    """--inference estimates a forward of the model as served (model.eval()); a training step, training mode."""
    modes = []
    real_estimate = memtorch.estimate

    def estimate(model, *inputs, **kwargs):
        modes.append(all(m.training for m in model.modules()) or not any(m.training for m in model.modules()))
        modes.append(model.training)
        return real_estimate(model, *inputs, **kwargs)

    monkeypatch.setattr(memtorch, "estimate", estimate)
    code, text = run("estimate", CONFIGS / "gpt2", "--batch", 2, "--seq", 32, "--inference", "--device", "cpu",
                     "--format", "json")  # fmt: skip
    assert code == 0 and modes == [True, False]
    model = models.load_model(CONFIGS / "gpt2").eval()
    est = real_estimate(model, models.example_inputs(model, 2, 32), device="cpu", training=False)
    assert json.loads(text)["peak"] == est.peak
    code, _ = run("estimate", CONFIGS / "gpt2", "--batch", 2, "--seq", 32, "--device", "cpu")
    assert code == 0 and modes[2:] == [True, True]


def test_cli_model_ids_and_their_errors(capsys, tmp_path, monkeypatch):
    code, text = run("inspect", "memtorch-tests/tiny-llama", "--format", "json")
    assert code == 0 and json.loads(text)["total"] == _unique_bytes(
        list(_by_hand(LLAMA).parameters()) + list(_by_hand(LLAMA).buffers())
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code, _ = run("estimate", "memtorch-tests/not-there", "--batch", 1, "--seq", 8)
    err = capsys.readouterr().err
    assert code == 2 and "no model 'memtorch-tests/not-there'" in err and str(tmp_path) in err
    code, _ = run("estimate", LLAMA, "--batch", 1, "--seq", 8, "--input", "1x8:int64")
    assert code == 2 and "--input and --batch/--seq: give one" in capsys.readouterr().err
    code, _ = run("estimate", LLAMA)
    assert code == 2 and "--batch B --seq L" in capsys.readouterr().err
    code, _ = run("estimate", CONFIGS / "gpt2", "--batch", 1, "--seq", 1000)
    assert code == 2 and "longer than the model's 256 learned positions" in capsys.readouterr().err
    if peft is not None:
        code, _ = run("estimate", LLAMA, "--batch", 1, "--seq", 8, "--lora", "rank=8")
        assert code == 2 and "unknown key 'rank'" in capsys.readouterr().err


@needs_peft
def test_cli_lora_on_a_callable_target_not_on_a_module_object(tmp_path, monkeypatch, capsys):
    (tmp_path / "lm_factories.py").write_text(
        "import transformers\n"
        f"CONFIG = transformers.AutoConfig.from_pretrained({str(LLAMA)!r})\n"
        "def make():\n    return transformers.LlamaForCausalLM(CONFIG)\n"
        "instance = make()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code, text = run("estimate", "lm_factories:make", "--batch", 2, "--seq", 16, "--lora", "r=8",
                         "--device", "cpu", "--format", "json")  # fmt: skip
        assert code == 0, capsys.readouterr().err
        assert json.loads(text)["model_states"]["gradient"] == 4 * ADAPTER_NUMEL  # peft's llama default: q, v
        code, _ = run("estimate", "lm_factories:instance", "--batch", 2, "--seq", 16, "--lora", "r=8")
        assert code == 2 and "is a module object, and peft wraps a model in place" in capsys.readouterr().err
        code, _ = run("estimate", "lm_factories:make", "--batch", 2, "--seq", 16, "--task", "causal-lm")
        assert code == 2 and "--task applies to a model id or config" in capsys.readouterr().err
        mod = sys.modules["lm_factories"]
        assert type(mod.instance).__name__ == "LlamaForCausalLM"
        assert not any("lora" in n for n, _ in mod.instance.named_parameters())
    finally:
        sys.modules.pop("lm_factories", None)


def test_cli_batch_and_seq_for_plan_fit_and_advise(capsys):
    code, text = run("plan", LLAMA, "--batch", 2, "--seq", 16, "--device", "cpu", "--device-memory", "64 MiB",
                     "--reserve", "0", "--world-sizes", "1", "--precisions", "fp32", "--checkpointing",
                     "none", "--format", "json")  # fmt: skip
    assert code == 0, capsys.readouterr().err
    meta = models.load_model(LLAMA)
    est = memtorch.estimate(meta, models.example_inputs(meta, 2, 16), device="cpu")
    (option,) = json.loads(text)["options"]
    assert option["peak"] == est.peak and option["fits"] and option["micro_batch"] == 2
    code, text = run("fit", LLAMA, "--batch", 1, "--seq", 16, "--vary", "seq", "--device", "cpu",
                     "--device-memory", "6 MiB", "--reserve", "0", "--format", "json")  # fmt: skip
    assert code == 0, capsys.readouterr().err
    found = json.loads(text)["value"]
    within = memtorch.estimate(meta, models.example_inputs(meta, 1, found), device="cpu").peak
    over = memtorch.estimate(meta, models.example_inputs(meta, 1, found + 1), device="cpu").peak
    assert within <= 6 * 2**20 < over  # the largest length that fits, by two estimates of their own
    code, text = run("advise", LLAMA, "--batch", 2, "--seq", 16, "--device", "cpu")
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("function", ["estimate", "plan", "fit", "advise", "capacity"])
def test_a_model_name_given_where_a_module_is_needed_says_how_to_build_it(function):
    # a Hub id or a config.json path given to the Python API (the CLI takes names): the error names
    # load_model() and example_inputs(), and the command that takes the name itself
    args = (128, 16) if function == "capacity" else ()  # prompt_len, max_new_tokens
    for given in ("gpt2", pathlib.Path("some/config.json")):
        with pytest.raises((MemtorchError, TypeError)) as e:
            getattr(memtorch, function)(given, *args)
        text = str(e.value)
        assert f"{function}() needs a torch.nn.Module" in text
        assert f"memtorch.load_model({str(given)!r})" in text and "memtorch.example_inputs(model" in text
        assert f"memtorch {function} NAME" in text
    with pytest.raises((MemtorchError, TypeError), match=r"needs a torch.nn.Module, got int$"):
        getattr(memtorch, function)(5, *args)
