"""Optimizers by name (memtorch._optimizers, estimation._make_optimizer): each state and each step's peak
against the real optimizer on the CPU, or against a hand count from the optimizer's source.

Truth: the real optimizer (bitsandbytes' own class, transformers' Adafactor, torch's) steps a small model
whose parameters lie both above and below bitsandbytes' min_8bit_size (4096 elements); the bytes of the
unique storages its ``state`` holds after the step equal what estimate(device="cpu") reports as optimizer
state, and memtorch.track()'s peak of two real steps (forward, backward, step) equals the estimate's peak.
Each optional library is imported before a measurement starts: importing bitsandbytes keeps 128 B of tensors
(measured here), which are not the step's.
"""

import functools
import gc
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import memtorch
from memtorch import cpu
from memtorch.errors import MemtorchError
from memtorch.estimator.estimate import OPTIMIZERS, _make_optimizer

BNB_CLASS = {
    "adamw8bit": "AdamW8bit", "adam8bit": "Adam8bit", "paged_adamw8bit": "PagedAdamW8bit",
    "paged_adamw": "PagedAdamW", "lion": "Lion", "lion8bit": "Lion8bit", "paged_lion8bit": "PagedLion8bit",
}  # fmt: skip


def make_model(dtype=torch.float32):
    # weights of 8192 elements (8-bit state) and 2048 elements (32-bit state), biases of 128 and 16
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16)).to(dtype)


def make_input(dtype=torch.float32):
    return torch.randn(8, 64, dtype=dtype)


def bnb():
    pytest.importorskip("bitsandbytes")  # prints a line about its CPU kernels on import
    import bitsandbytes

    return bitsandbytes


def state_bytes(opt):
    """The bytes of the unique storages the optimizer's state holds (a storage shared by several
    parameters, as bitsandbytes' quantization maps are, counted once)."""
    seen = {}
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                s = v.untyped_storage()
                seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def measured(make_opt, dtype=torch.float32, steps=2):
    """(track()'s peak of ``steps`` real steps counted from before the model is built, the optimizer, the
    model, the input), as estimate() runs them (the output alive until the step ends)."""
    cpu.start()
    gc.collect()
    base = cpu.allocated()
    model, x = make_model(dtype), make_input(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: paged optimizers fall back on the CPU
        opt = make_opt(list(model.parameters()))
        with memtorch.track(model, optimizer=opt) as t:
            for _ in range(steps):
                out = model(x)
                loss = out.sum()
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
                out = None
    assert t.report.exact
    return t.report.peak - base, opt, model, x


# ---------------------------------------------------------------- bitsandbytes, against the real optimizer


@pytest.mark.parametrize("name", sorted(BNB_CLASS))
def test_bnb_state_and_peak_match_the_real_optimizer(name):
    cls = getattr(bnb().optim, BNB_CLASS[name])
    peak, opt, model, x = measured(cls)
    est = memtorch.estimate(model, x, optimizer=name, device="cpu")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    # memtorch.inspect() of the real optimizer (its walker counts the shared maps once) says the same
    assert memtorch.inspect(model, optimizer=opt).by_category["optimizer_state"] == state_bytes(opt)
    assert est.peak == peak


def test_bnb_8bit_state_in_bf16_matches_the_real_optimizer():
    # bf16 parameters: bitsandbytes' CPU step works on float32 copies of the gradient and the parameter
    b = bnb()
    peak, opt, model, x = measured(b.optim.AdamW8bit, dtype=torch.bfloat16)
    est = memtorch.estimate(model, x, optimizer="adamw8bit", device="cpu", precision="bf16-true")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    assert est.peak == peak


def test_bnb_qmaps_are_one_storage_for_all_parameters():
    # the premise of counting a quantization map once: every 8-bit parameter's state holds the same tensor
    b = bnb()
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    opt = b.optim.AdamW8bit(model.parameters())
    model(make_input()).sum().backward()
    opt.step()
    big = [st for st in opt.state.values() if st["state1"].dtype == torch.uint8]
    assert len(big) == 2
    assert big[0]["qmap1"] is big[1]["qmap1"] and big[0]["qmap2"] is big[1]["qmap2"]
    assert big[0]["qmap1"].untyped_storage().nbytes() == 256 * 4


# ---------------------------------------------------------------- by hand, from bitsandbytes' source


def test_adamw8bit_state_by_hand():
    # Optimizer2State.init_state: n >= 4096 -> uint8 state1, state2 (n bytes each), float32 absmax1, absmax2
    # (ceil(n / 256) each), and the two shared 256-entry float32 maps; n < 4096 -> float32 state1, state2
    est = memtorch.estimate(make_model(), make_input(), optimizer="adamw8bit", device="cpu")
    big = 2 * 8192 + 2 * 4 * 32
    small = 8 * (128 + 2048 + 16)
    assert est.model_states["optimizer_state"] == big + small + 2 * 256 * 4


def test_lion8bit_state_by_hand():
    # Optimizer1State.init_state: one state, one absmax, one map ('dynamic')
    est = memtorch.estimate(make_model(), make_input(), optimizer="lion8bit", device="cpu")
    assert est.model_states["optimizer_state"] == 8192 + 4 * 32 + 4 * (128 + 2048 + 16) + 256 * 4


def test_absmax_rounds_up_to_a_block():
    # 4097 elements: 17 blocks of 256 (the last one partial)
    model = nn.Linear(4097, 1, bias=False)
    est = memtorch.estimate(model, (2, 4097), optimizer="adamw8bit", device="cpu")
    assert est.model_states["optimizer_state"] == 2 * 4097 + 2 * 4 * 17 + 2 * 256 * 4


def test_cuda_state_by_hand():
    # on a GPU the maps are copied to the device once (the host maps are dropped) and each tensor is a
    # caching-allocator block (512 B granularity); the step is one fused kernel
    def block(n):
        return -(-n // 512) * 512

    est = memtorch.estimate(make_model(), make_input(), optimizer="adamw8bit", device="cuda", gpu="h100")
    want = 2 * block(8192) + 2 * block(4 * 32) + 2 * block(1024)
    want += sum(2 * block(4 * n) for n in (128, 2048, 16))
    assert est.model_states["optimizer_state"] == want


def test_paged_state_on_cuda_is_noted():
    # Optimizer8bit.get_state_buffer: paged (CUDA managed memory) for parameters of >= 1e5 elements
    model = nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 8))  # 131072 and 2048 elements
    est = memtorch.estimate(model, (4, 512), optimizer="paged_adamw8bit", device="cuda", gpu="h100")
    note = [n for n in est.notes if "managed memory" in n]
    assert len(note) == 1 and "2 state tensor(s)" in note[0] and "256.0 KiB in all" in note[0]
    plain = memtorch.estimate(model, (4, 512), optimizer="adamw8bit", device="cuda", gpu="h100")
    assert est.model_states["optimizer_state"] == plain.model_states["optimizer_state"]
    assert not [n for n in plain.notes if "managed memory" in n]
    on_cpu = memtorch.estimate(model, (4, 512), optimizer="paged_adamw8bit", device="cpu")
    assert not [n for n in on_cpu.notes if "managed memory" in n]


# ---------------------------------------------------------------- a user's bitsandbytes optimizer


def test_a_bnb_instance_is_estimated_with_its_settings():
    b = bnb()
    # min_8bit_size above every parameter: all state in 32 bits
    peak, opt, model, x = measured(lambda p: b.optim.AdamW8bit(p, min_8bit_size=10**6))
    est = memtorch.estimate(model, x, optimizer=b.optim.AdamW8bit(model.parameters(), min_8bit_size=10**6),
                            device="cpu")  # fmt: skip
    assert (
        est.model_states["optimizer_state"]
        == state_bytes(opt)
        == 8 * sum(p.numel() for p in model.parameters())
    )
    assert est.peak == peak


@pytest.mark.parametrize("how", ["class", "partial", "lambda"])
def test_a_bnb_factory_is_estimated(how):
    b = bnb()
    peak, opt, model, x = measured(functools.partial(b.optim.Lion8bit, min_8bit_size=2048))
    factory = {
        "class": None,
        "partial": functools.partial(b.optim.Lion8bit, min_8bit_size=2048),
        "lambda": lambda p: b.optim.Lion8bit(p, min_8bit_size=2048),
    }[how]
    if factory is None:
        peak, opt, model, x = measured(b.optim.Lion8bit)
        factory = b.optim.Lion8bit
    est = memtorch.estimate(model, x, optimizer=factory, device="cpu")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    assert est.peak == peak


# bitsandbytes' other updates, given as a class or a partial: LAMB and LARS (max_unorm: an update norm read
# with .item() in the step, unorm_vec in the state), SGD with momentum, RMSprop, Adagrad; weight decay where
# it adds a temporary on the CPU (the 32-bit momentum/RMSprop/Adagrad steps)
OTHER_KINDS = {
    "LAMB": lambda b: b.optim.LAMB,
    "LAMB8bit": lambda b: b.optim.LAMB8bit,
    "LARS": lambda b: functools.partial(b.optim.LARS, lr=0.1, momentum=0.9),
    "LARS8bit": lambda b: functools.partial(b.optim.LARS8bit, lr=0.1, momentum=0.9),
    "SGD": lambda b: functools.partial(b.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01),
    "SGD8bit": lambda b: functools.partial(b.optim.SGD8bit, lr=0.1, momentum=0.9),
    "RMSprop": lambda b: functools.partial(b.optim.RMSprop, weight_decay=0.01),
    "RMSprop8bit": lambda b: b.optim.RMSprop8bit,
    "Adagrad": lambda b: b.optim.Adagrad,
    "Adagrad8bit": lambda b: b.optim.Adagrad8bit,
}


@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_bnb_optimizers_of_every_update_match(kind):
    factory = OTHER_KINDS[kind](bnb())
    peak, opt, model, x = measured(factory)
    est = memtorch.estimate(model, x, optimizer=factory, device="cpu")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    assert est.peak == peak


def test_a_bnb_optimizer_without_a_stand_in_is_a_clear_error():
    b = bnb()
    model = make_model()
    with pytest.raises(MemtorchError, match="AdEMAMix8bit.*no stand-in"):
        memtorch.estimate(
            model, make_input(), optimizer=b.optim.AdEMAMix8bit(model.parameters()), device="cpu"
        )


def test_bitsandbytes_is_not_imported_by_the_names():
    code = (
        "import sys, torch, memtorch\n"
        "m = torch.nn.Linear(128, 64)\n"
        "for name in ('adamw8bit', 'paged_adamw8bit', 'lion8bit', 'lion'):\n"
        "    memtorch.estimate(m, (2, 128), optimizer=name, device='cpu')\n"
        "print('bitsandbytes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- TrainingArguments' names, as the Trainer builds them

TRAINER_NAMES = [
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "lion_32bit",
    "paged_lion_8bit", "paged_lion_32bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
]  # fmt: skip


class Tagger(nn.Module):
    # an embedding of 6400 elements: 8-bit state by bitsandbytes' size rule, 32-bit under the Trainer
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.fc = nn.Linear(64, 128)
        self.out = nn.Linear(128, 16)

    def forward(self, ids):
        return self.out(self.fc(self.emb(ids)).relu())


@pytest.fixture
def bnb_manager():
    """bitsandbytes' GlobalOptimManager, emptied after the test (the Trainer registers its module
    overrides there, process-wide)."""
    b = bnb()
    mng = b.optim.GlobalOptimManager.get_instance()
    yield mng
    mng.initialize()


@pytest.mark.parametrize("name", TRAINER_NAMES)
def test_trainer_names_match_the_trainers_optimizer(name, bnb_manager, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = Tagger()
    ids = torch.randint(0, 100, (8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), optim=name, report_to=[], use_cpu=True
        )
        opt = transformers.Trainer(model=model, args=args).create_optimizer()
        # what the estimate holds from the start and the measurement does not: parameters, input, the
        # optimizer's quantization maps (made by its constructor)
        before = (
            sum(p.untyped_storage().nbytes() for p in model.parameters()) + ids.untyped_storage().nbytes()
        )
        before += sum(q.untyped_storage().nbytes() for q in opt.name2qmap.values())
        cpu.start()
        gc.collect()
        base = cpu.allocated()
        with memtorch.track(model, optimizer=opt) as t:
            for _ in range(2):
                out = model(ids)
                loss = out.sum()
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
                out = None
    assert t.report.exact
    emb = opt.state[model.emb.weight]["state1"].dtype
    assert emb == torch.float32  # the Trainer's override (8-bit runs) or 32-bit state throughout
    est = memtorch.estimate(model, ids, optimizer=name, device="cpu")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    assert est.peak == t.report.peak - base + before


def test_trainer_override_applies_to_embeddings_only():
    # by hand: adamw_bnb_8bit keeps the 6400-element embedding's two states in float32; adamw8bit does not
    model, ids = Tagger(), torch.zeros(8, 4, dtype=torch.long)
    trainer = memtorch.estimate(model, ids, optimizer="adamw_bnb_8bit", device="cpu")
    plain = memtorch.estimate(model, ids, optimizer="adamw8bit", device="cpu")
    eight = 2 * 6400 + 2 * 4 * 25
    assert trainer.model_states["optimizer_state"] - plain.model_states["optimizer_state"] == 8 * 6400 - eight


def test_a_bnb_instance_keeps_its_manager_overrides(bnb_manager):
    # GlobalOptimManager.override_config: fc.weight (8192 elements) in 32 bits
    b = bnb()
    torch.manual_seed(0)
    cpu.start()
    gc.collect()
    base = cpu.allocated()
    model, x = make_model(), make_input()
    bnb_manager.override_config(model[0].weight, "optim_bits", 32)
    opt = b.optim.AdamW8bit(model.parameters())
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(2):
            out = model(x)
            loss = out.sum()
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = None
    assert opt.state[model[0].weight]["state1"].dtype == torch.float32
    est = memtorch.estimate(model, x, optimizer=opt, device="cpu")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    assert est.peak == t.report.peak - base


# ---------------------------------------------------------------- Adafactor and the torch names


def test_adafactor_is_transformers_as_the_trainer_builds_it():
    transformers = pytest.importorskip("transformers")
    from transformers.optimization import Adafactor

    def trainer(params):
        # transformers' trainer_optimizer._get_adafactor: scale_parameter=False, relative_step=False, the lr
        return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False)

    peak, opt, model, x = measured(trainer)
    est = memtorch.estimate(model, x, optimizer="adafactor", device="cpu")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    assert est.peak == peak
    # factored second moment: a row and a column per matrix, the full vector for a bias; an RMS scalar each
    assert state_bytes(opt) == 4 * ((128 + 64) + (16 + 128) + 128 + 16) + 4 * 4
    assert transformers is not None


def test_adafactor_state_on_cuda_by_hand():
    # transformers' Adafactor makes a factor on the host and sends it to the GPU (torch.zeros(shape).to(grad)):
    # on cuda each of a matrix's row and column factors, a vector's exp_avg_sq and each parameter's RMS
    # scalar is one 512-byte block of the caching allocator: 2 matrices x 2 + 2 vectors + 4 RMS
    pytest.importorskip("transformers")
    est = memtorch.estimate(make_model(), make_input(), optimizer="adafactor", device="cuda", gpu="h100")
    assert est.model_states["optimizer_state"] == 10 * 512


@pytest.mark.parametrize("name", ["adafactor-torch", "adafactor-torch-foreach"])
def test_torch_adafactor_matches_the_real_step(name):
    peak, opt, model, x = measured(lambda p: _make_optimizer(name, p, "cpu"))
    assert type(opt) is torch.optim.Adafactor
    est = memtorch.estimate(model, x, optimizer=name, device="cpu")
    assert est.model_states["optimizer_state"] == state_bytes(opt)
    assert est.peak == peak


def test_the_stand_in_is_named_in_a_note():
    est = memtorch.estimate(make_model(), make_input(), optimizer="adamw8bit", device="cpu")
    assert any(n.startswith("the optimizer, AdamW8bit, is a stand-in") and "0.50" in n for n in est.notes)
    plain = memtorch.estimate(make_model(), make_input(), optimizer="adamw", device="cpu")
    assert not any("stand-in" in n for n in plain.notes)


def test_names_are_listed_and_checked():
    for name in ("adamw8bit", "paged_adamw8bit", "adafactor", "lion", "sgd", "adamw", "adamw-fused"):
        assert name in OPTIMIZERS
    with pytest.raises(MemtorchError, match="unknown optimizer 'adamw9bit'.*adamw8bit"):
        memtorch.estimate(make_model(), make_input(), optimizer="adamw9bit", device="cpu")


def test_sharded_8bit_state_says_what_is_not_modelled():
    model = make_model()
    zero2 = memtorch.estimate(
        model, make_input(), optimizer="adamw8bit", device="cpu", world_size=2, sharding="zero2"
    )
    assert any("min_8bit_size" in n and "not modelled" in n for n in zero2.notes)
    ddp = memtorch.estimate(
        model, make_input(), optimizer="adamw8bit", device="cpu", world_size=2, sharding="ddp"
    )
    assert not any("min_8bit_size" in n for n in ddp.notes)
    # under DDP every rank holds the whole state
    one = memtorch.estimate(model, make_input(), optimizer="adamw8bit", device="cpu")
    assert ddp.model_states["optimizer_state"] == one.model_states["optimizer_state"]


# ---------------------------------------------------------------- advise()'s 8-bit row


@pytest.mark.parametrize("framework, name", [("torch", "adamw8bit"), ("transformers", "adamw_bnb_8bit")])
def test_advise_8bit_row_is_the_estimate_of_its_line(framework, name):
    # the row's figure is estimate()'s step with the optimizer its printed line builds: AdamW8bit by hand, or
    # the Trainer's optim='adamw_bnb_8bit' (the embedding's state in 32 bits); on cuda (bitsandbytes' fused
    # step, no temporaries) against torch's foreach AdamW
    model, ids = Tagger(), torch.zeros(8, 4, dtype=torch.long)
    est = memtorch.estimate(model, ids, optimizer=name, device="cuda", gpu="h100")
    # a budget the 8-bit step fits to the byte (judged on cuda: its reserved peak, the reserve 0)
    adv = memtorch.advise(model, ids, optimizer="adamw", device="cuda", gpu="h100", framework=framework,
                          budget=est.reserved_peak, reserve=0)  # fmt: skip
    (row,) = adv.by_kind("optimizer_8bit")
    assert row.before == adv.peak > est.peak and row.after == est.peak and row.fits is True
    assert row.basis == "estimated by memtorch.estimate" and f"optimizer={name!r}" in row.detail
    assert row.code["torch"].startswith("bitsandbytes.optim.AdamW8bit")
    assert "adamw_bnb_8bit" in row.code["transformers"]


def test_advise_8bit_is_a_note_when_the_step_peaks_higher():
    # on the CPU bitsandbytes' step makes float32 copies of a parameter's states and gradient: for this small
    # model, with the Trainer's 32-bit embedding, the step peaks higher than torch's AdamW
    model, ids = Tagger(), torch.zeros(8, 4, dtype=torch.long)
    adv = memtorch.advise(model, ids, optimizer="adamw", device="cpu", framework="transformers")
    est = memtorch.estimate(model, ids, optimizer="adamw_bnb_8bit", device="cpu")
    assert est.peak > adv.peak and not adv.by_kind("optimizer_8bit")
    (note,) = [n for n in adv.notes if n.startswith("8-bit optimizer state")]
    assert memtorch.units.format(est.peak) in note and "float32 copies" in note
