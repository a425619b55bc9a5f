"""cpu_advise(): each suggestion's bytes against a hand count.

Hand counts: a float32 element is 4 bytes, 2 in bfloat16; Linear(i, o) holds
i*o + o elements; Adam keeps exp_avg and exp_avg_sq of each parameter's size
plus a float32 'step' scalar per parameter (4 B) on the CPU; a CSR matrix holds
rows + 1 and nnz int64 indices and nnz values, a COO tensor ndim * nnz int64
indices and nnz values. Savings measured by running steps (checkpointing,
autocast, depth) are checked against a separate manual run under
memtorch.cpu.Scope with the change applied by hand.
"""

import copy
import gc
import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memtorch
from memtorch import advice

F32 = 4


def cpu_advise(*args, **kwargs):
    """memtorch.advise() for the CPU (its default device is cuda), a CPU model's steps measured (measure=True),
    the optimizer as given (None: none), and no reserve kept free of a budget (these budgets are KiB)."""
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("optimizer", None)
    kwargs.setdefault("reserve", 0)
    model = args[0] if args else None
    on_meta = isinstance(model, nn.Module) and any(p.device.type == "meta" for p in model.parameters())
    kwargs.setdefault("measure", len(args) > 1 and not on_meta)
    return memtorch.advise(*args, **kwargs)


def lin(i, o, bias=True):
    return (i * o + (o if bias else 0)) * F32


def test_bf16_weights_without_inputs_is_half_the_float32_parameters():
    model = nn.Linear(100, 50)
    adv = cpu_advise(model)
    (s,) = adv.by_kind("bf16_weights")
    assert s.saves == lin(100, 50) // 2 == 10_100
    assert s.basis == "exact arithmetic"
    assert "after backward they add as much again" in s.detail


def test_bf16_weights_after_a_step_halves_parameters_gradients_and_adam_state():
    model = nn.Linear(100, 50)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 100)).sum().backward()
    opt.step()
    adv = cpu_advise(model, optimizer=opt)
    (s,) = adv.by_kind("bf16_weights")
    # parameters + gradients + exp_avg + exp_avg_sq, halved; the 'step' scalars stay float32
    assert s.saves == 4 * lin(100, 50) // 2 == 40_400


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_csr_bytes_exact():
    model = nn.Linear(100, 100, bias=False)
    with torch.no_grad():
        model.weight.zero_()
        model.weight.view(-1)[::20] = 1.0  # 500 non-zeros: 95% zeros
    adv = cpu_advise(model)
    (s,) = adv.by_kind("sparse")
    csr = 101 * 8 + 500 * 8 + 500 * F32  # 6,808 B
    coo = 2 * 500 * 8 + 500 * F32  # 10,000 B
    assert s.after == csr and s.before == 100 * 100 * F32
    assert s.saves == 40_000 - 6_808
    assert "CSR" in s.title and "COO 9.8 KiB (10,000 B)" in s.detail
    assert s.basis == "measured"
    # the same figures measured on the real sparse tensors (what advise() checks its count against)
    w = model.weight.detach()
    assert memtorch.sizeof(w.to_sparse_csr().clone()).total == csr
    assert memtorch.sizeof(w.to_sparse()).total == coo
    # to_sparse_csr() alone keeps the COO index storage (2 x 500 int64) behind its column indices
    assert memtorch.sizeof(w.to_sparse_csr()).total == 101 * 8 + 2 * 500 * 8 + 500 * F32
    assert "w.to_sparse_csr() alone holds 10.6 KiB (10,808 B)" in s.detail


def test_sparse_not_suggested_when_it_would_be_larger():
    model = nn.Linear(4, 100)
    with torch.no_grad():
        model.bias.zero_()
        model.bias[:40] = 1.0  # 60% zeros: COO 40*8 + 40*4 = 480 B > dense 400 B
        model.weight.fill_(1.0)
    adv = cpu_advise(model)
    assert adv.by_kind("sparse") == []
    assert any("bias" in n and "COO 480 B" in n and "would not be smaller" in n for n in adv.notes)


class WithDeadParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.unused = nn.Linear(10, 20)
        self.side = nn.Linear(16, 4)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        for layer in self.body:
            x = torch.relu(layer(x))
        self.side(x.detach())  # runs, but its output reaches no loss: no gradient
        return self.head(x)


def test_unused_modules_and_parameters_without_gradient():
    model = WithDeadParts()
    opt = torch.optim.Adam(model.parameters())
    adv = cpu_advise(model, torch.ones(8, 16), optimizer=opt)
    (dead,) = adv.by_kind("unused_modules")
    assert dead.saves == lin(10, 20) == 880  # never called: no gradient, no Adam state either
    assert "unused" in dead.title and "body" not in dead.title  # a ModuleList runs through its layers
    assert dead.basis == "measured"
    (nograd,) = adv.by_kind("no_gradient")
    assert nograd.saves == lin(16, 4) == 272
    assert "side.weight" in nograd.title and "side.bias" in nograd.title
    # the user's model and optimizer are untouched
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_optimizer_state_measured_after_a_step():
    model = nn.Linear(100, 50)
    opt = torch.optim.Adam(model.parameters())
    adv = cpu_advise(model, torch.ones(4, 100), optimizer=opt)
    (sgd,) = adv.by_kind("optimizer_sgd")
    (mom,) = adv.by_kind("optimizer_momentum")
    assert sgd.saves == 2 * lin(100, 50) + 2 * 4 == 40_408
    assert mom.saves == lin(100, 50) + 2 * 4 == 20_208
    assert sgd.basis == "measured" and mom.basis == "exact arithmetic"


def test_optimizer_state_by_arithmetic_before_the_first_step():
    model = nn.Linear(100, 50)
    opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    adv = cpu_advise(model, optimizer=opt)
    assert cpu_advise(model, torch.ones(2, 100), optimizer=opt).by_kind("optimizer_sgd")[0].saves == (
        3 * lin(100, 50) + 2 * 4
    )  # the copy of an AdamW (whose defaults hold a key its constructor refuses) steps and measures the same
    (sgd,) = adv.by_kind("optimizer_sgd")
    assert sgd.saves == 3 * lin(100, 50) + 2 * 4
    assert sgd.basis == "exact arithmetic" and "max_exp_avg_sq" in sgd.detail
    plain = cpu_advise(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert plain.by_kind("optimizer_sgd") == [] and any("SGD keeps no state" in n for n in plain.notes)


def test_freeze_largest_child():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 5))
    opt = torch.optim.Adam(model.parameters())
    adv = cpu_advise(model, torch.ones(3, 10), optimizer=opt)
    (s,) = adv.by_kind("freeze")
    p = lin(10, 20)
    assert s.saves == p + 2 * p + 2 * 4  # its gradients + exp_avg + exp_avg_sq + 2 step scalars
    assert s.title.startswith("Freeze 0 (Linear)")


class _TiedLM(nn.Module):
    """A body holding the embedding and a head whose weight is the embedding's (GPT-2's lm_head)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.body[0].weight

    def forward(self, ids):
        return self.head(self.body(ids))


def test_freeze_is_not_advised_where_it_would_leave_nothing_to_learn():
    # the largest child holds every trainable parameter: the head's weight is the body's embedding
    # (tied), or the other child has none; freezing it would train nothing: no row, a note says why
    # (was: "Freeze transformer (GPT2Model): it stops learning" for GPT-2, whose lm_head is tied)
    model = _TiedLM()
    ids = torch.ones(2, 4, dtype=torch.long)
    adv = cpu_advise(model, ids, optimizer=torch.optim.Adam(model.parameters()))
    assert adv.by_kind("freeze") == []
    assert any(n.startswith("freezing: body (Sequential) holds every trainable parameter of the model (another "
                            "module's are the same tensors: tied)") for n in adv.notes), adv.notes
    plain = nn.Sequential(nn.Linear(10, 20), nn.ReLU())
    adv = cpu_advise(plain, torch.ones(3, 10), optimizer=torch.optim.Adam(plain.parameters()))
    assert adv.by_kind("freeze") == []
    assert "freezing: 0 (Linear) holds every trainable parameter of the model: freezing it would leave nothing " \
           "to learn" in adv.notes, adv.notes
    # with the head untied, freezing the body leaves the head to learn: the row is there; the optimizer
    # given by name, freezing counts its state by arithmetic (AdamW: 2 x the parameters' bytes + 4 B steps)
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    adv = memtorch.advise(model, ids, optimizer="adamw", device="cpu", reserve=0)
    (s,) = adv.by_kind("freeze")
    assert s.title.startswith("Freeze body (Sequential)")
    body = list(model.body.parameters())
    pbytes = sum(p.numel() * 4 for p in body)
    assert s.saves == pbytes + 2 * pbytes + 4 * len(body)


def _manual_peak(model, x, steps=2, wrap=None, autocast=False, dtype=None):
    """A step peak measured without advise(): a copy, the change applied by hand, memtorch.cpu.Scope."""
    m = copy.deepcopy(model)
    if dtype is not None:
        m.to(dtype)
        x = x.to(dtype)
    if wrap:
        for name in wrap:
            blk = m.get_submodule(name)
            blk.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(blk.forward)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    held = sum(p.untyped_storage().nbytes() for p in m.parameters())
    gc.collect()  # earlier copies in reference cycles must not be freed inside the scope
    with memtorch.cpu.Scope() as s:
        for _ in range(steps):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = m(x)
                loss = out.sum()  # advise's default loss: the sum of the output
            del out
            loss.backward()
            del loss
            opt.step()
    for name in wrap or ():
        m.get_submodule(name).__dict__.pop("forward", None)  # break the cycle through the patched forward
    return held + s.peak_above_start


def blocks(n=4, d=32):
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU()) for _ in range(n)]
    )


def test_checkpointing_and_autocast_match_a_manual_run():
    torch.manual_seed(0)
    model = blocks()
    x = torch.randn(512, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adv = cpu_advise(model, x, optimizer=opt)
    base = _manual_peak(model, x)
    assert adv.peak == base
    (ck,) = adv.by_kind("checkpointing")
    assert ck.saves == base - _manual_peak(model, x, wrap=["0", "1", "2", "3"])
    assert ck.basis == "measured" and ck.saves > 0
    (ac,) = adv.by_kind("autocast_bf16")
    assert ac.saves == base - _manual_peak(model, x, autocast=True)
    (bf,) = adv.by_kind("bf16_weights")
    assert bf.saves == base - _manual_peak(model, x, dtype=torch.bfloat16) and bf.basis == "measured"
    # of which held all through: parameters and gradients, 4 blocks of 2 Linear(32, 32), halved
    # 2 x 8 x (32*32 + 32) x 4 B = 67,584 B, the parameters' and their gradients' halves
    held = ("in float32 now: parameters 33.0 KiB, gradients 33.0 KiB, 66.0 KiB in all; "
            "in bfloat16, half: 33.0 KiB")
    assert held in bf.detail


def test_depth_for_a_budget():
    torch.manual_seed(0)
    model = blocks(n=6)
    x = torch.randn(256, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    full = _manual_peak(model, x)
    three = _manual_peak(blocks(n=3), x)
    four = _manual_peak(blocks(n=4), x)
    assert cpu_advise(model, x, optimizer=opt, budget=(three + four) // 2).by_kind("depth") == []  # not asked
    adv = cpu_advise(model, x, optimizer=opt, budget=(three + four) // 2, remove_layers=True)
    (s,) = adv.by_kind("depth")
    assert s.group == "changes the model" and s.fits
    assert s.title == "Keep 3 of the 6 blocks in the model to fit the budget"
    assert s.after == three and s.saves == full - three
    fits = cpu_advise(model, x, optimizer=opt, budget=full, remove_layers=True)
    assert fits.by_kind("depth") == [] and any("the step as it is fits" in n for n in fits.notes)


def test_width_with_resize():
    torch.manual_seed(0)
    x = torch.randn(64, 32)

    def make(factor):
        w = int(64 * factor)
        return nn.Sequential(nn.Linear(32, w), nn.ReLU(), nn.Linear(w, 1))

    full = _manual_peak(make(1.0), x)
    half = _manual_peak(make(0.5), x)
    adv = cpu_advise(
        make(1.0), x, optimizer=torch.optim.SGD(make(1.0).parameters(), lr=0.1), budget=half, resize=make
    )
    (s,) = adv.by_kind("width")
    assert s.after <= half and s.saves == full - s.after


def test_ranked_and_rendered():
    model = WithDeadParts()
    opt = torch.optim.Adam(model.parameters())
    adv = cpu_advise(model, torch.ones(8, 16), optimizer=opt, budget="1 MiB")
    saves = [s.saves for s in adv]
    groups = [advice.GROUPS.index(s.group) for s in adv]
    assert groups == sorted(groups) and len(adv) >= 4  # by group, in the order a user would try them
    text = str(adv)
    assert text.startswith("memtorch.advise for WithDeadParts")
    for s in adv:
        assert s.title in text and f"{s.saves:,} B" in text and s.basis in text
    assert "savings do not add up" in text
    page = adv._repr_html_()
    assert page.startswith('<div class="memtorch memtorch-advice">') and "<table" in page
    d = adv.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert [i["saves"] for i in d["items"]] == saves and d["budget"] == 2**20


@pytest.mark.parametrize(
    "args, kw, exc, msg",
    [
        ((), {}, TypeError, "advise\\(\\) needs a torch.nn.Module, got str"),
        ((), {"optimizer": 3}, TypeError, "advise\\(optimizer=...\\) expects a name"),
        ((), {"optimizer": "adamm"}, memtorch.MemtorchError, "unknown optimizer 'adamm'"),
        ((), {"budget": "12 parsecs"}, memtorch.UnitError, "unknown unit"),
        ((), {"budget": "1 MiB"}, memtorch.MemtorchError, "needs example inputs"),
        ((), {"loss_fn": 3}, TypeError, "loss_fn=...\\) expects a callable"),
        ((), {"sparse_threshold": 1.5}, ValueError, "a fraction in \\(0, 1\\)"),
    ],
)
def test_bad_arguments(args, kw, exc, msg):
    model = "not a model" if not kw else nn.Linear(2, 2)
    with pytest.raises(exc, match=msg):
        cpu_advise(model, *args, **kw)


def test_model_that_fails_to_run_leaves_nothing_behind():
    model = nn.Linear(4, 2)
    with pytest.raises(RuntimeError):
        cpu_advise(model, torch.ones(3, 5))  # wrong width: the forward raises; the fixture checks hooks


def test_submodule_import_does_not_shadow_the_function():
    import memtorch.estimator.advise  # noqa: F401

    assert callable(memtorch.advise) and memtorch.advise is advice.advise


def test_model_that_cannot_be_copied():
    class NoCopy(nn.Linear):
        def __deepcopy__(self, memo):
            raise TypeError("holds a file handle")

    with pytest.raises(
        memtorch.MemtorchError, match="copy.deepcopy\\(model\\) failed: TypeError: holds a file handle"
    ):
        cpu_advise(NoCopy(2, 2), torch.ones(1, 2))


def test_sampled_peaks_are_not_called_exact():
    assert advice._measured({"exact": True}, {"exact": True}) == "measured"
    assert (
        advice._measured({"exact": True}, {"exact": False})
        == "measured (not exact: the counters sampled the peak)"
    )


def test_estimate_mode_against_estimate_and_measurement():
    torch.manual_seed(0)
    model = blocks()
    x = torch.randn(512, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    est = cpu_advise(model, x, optimizer=opt, measure=False)
    # every figure is estimate()'s for that configuration, with its defaults (the output kept alive)
    direct = memtorch.estimate(model, x, optimizer=opt, device="cpu")
    assert est.peak == direct.peak
    (ck,) = est.by_kind("checkpointing")
    assert ck.basis == "estimated by memtorch.estimate" and "dry run" in ck.detail
    with_ck = memtorch.estimate(model, x, optimizer=opt, checkpointing=["0", "1", "2", "3"], device="cpu")
    assert (ck.before, ck.after, ck.saves) == (direct.peak, with_ck.peak, direct.peak - with_ck.peak)
    # the estimate holds to the measurement (memtorch.estimate's own goal: within 3%): measured runs delete
    # the output before backward and leave the inputs apart
    measured = cpu_advise(model, x, optimizer=opt)
    loop = memtorch.estimate(model, x, optimizer=opt, device="cpu", keep_output=False)
    assert abs(loop.peak - loop.breakdown["input"] - measured.peak) <= 0.03 * measured.peak
    assert any("not known from an estimate" in n for n in est.notes)


def test_meta_model_is_estimated():
    with torch.device("meta"):
        model = blocks(n=2)
    x = torch.empty(64, 32, device="meta")
    adv = cpu_advise(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert adv.peak > 0 and all(s.basis.startswith(("estimated", "exact")) for s in adv)
    with pytest.raises(memtorch.MemtorchError, match="cannot run a model on the meta device"):
        cpu_advise(model, x, measure=True)
    with pytest.raises(ValueError, match="measure=...\\) expects True or False"):
        cpu_advise(model, x, measure="yes")


def test_sharded_configuration_is_estimated_with_its_fsdp_units():
    torch.manual_seed(0)
    model = blocks(n=3, d=128)
    x = torch.randn(8, 128)
    units = ["0"]  # blocks 1 and 2 left to the root's unit, gathered together (the default wraps each block)
    # world_size and sharding can only be estimated: measure=None estimates them (the model lives on the CPU)
    adv = cpu_advise(
        model, x, optimizer="adam", world_size=2, sharding="zero3", fsdp_units=units, measure=False
    )
    kw = dict(optimizer="adam", device="cpu", world_size=2, sharding="zero3")
    est = memtorch.estimate(model, x, fsdp_units=units, **kw)
    assert adv.peak == est.peak
    assert [u["name"] for u in est.fsdp_units] == ["0", "(model)"]
    default = memtorch.estimate(model, x, **kw)
    assert [u["name"] for u in default.fsdp_units] == ["0", "1", "2"] and default.peak != est.peak
    with pytest.raises(
        memtorch.MemtorchError, match="fsdp_units=...\\) applies to sharding='zero2' or 'zero3'"
    ):
        cpu_advise(model, x, fsdp_units=units)


def test_estimate_mode_copies_adamw():
    model = nn.Linear(100, 50)
    opt = torch.optim.AdamW(model.parameters())  # its defaults hold a key its constructor refuses
    adv = cpu_advise(model, torch.ones(4, 100), optimizer=opt, measure=False)
    (s,) = adv.by_kind("optimizer_sgd")
    assert s.saves == 2 * lin(100, 50) + 2 * 4 and s.basis == "exact arithmetic"


def test_step_scalars_are_host_memory_on_cuda():
    # on a GPU, Adam's 'step' scalars stay in host memory unless fused or capturable: switching to SGD
    # saves exp_avg and exp_avg_sq there, not the 2 x 4 B
    model = nn.Linear(100, 50)
    for kw, steps in (({}, 0), ({"fused": True}, 2 * 4), ({"capturable": True}, 2 * 4)):
        adv = memtorch.advise(model, optimizer=torch.optim.AdamW(model.parameters(), **kw), device="cuda")
        (s,) = adv.by_kind("optimizer_sgd")
        assert s.saves == 2 * lin(100, 50) + steps, kw
        assert ("in host memory, none on cuda" in s.detail) == (steps == 0)


def _gpt2_4_layers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=1024)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.slow
def test_gpt2_budget_first_suggestion_is_block_checkpointing():
    model = _gpt2_4_layers()
    ids = torch.zeros(8, 512, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    adv = memtorch.advise(model, batch, optimizer="adamw", budget="700 MiB", reserve=0, device="cpu")
    first = adv.items[0]
    assert first.kind == "checkpointing" and "transformer.h.0 .. transformer.h.3" in first.title
    # the figures are estimate()'s with checkpointing="blocks" (each GPT2Block), with its defaults
    plain = memtorch.estimate(model, batch, optimizer="adamw", device="cpu")
    blocks = memtorch.estimate(model, batch, optimizer="adamw", device="cpu", checkpointing="blocks")
    assert first.before == plain.peak == adv.peak and first.after == blocks.peak
    assert first.after <= 700 * 2**20 < first.before and first.fits
    # 25 zero-initialised biases: one grouped line among the also-considered, not 25 rows
    assert not adv.by_kind("sparse")
    assert any(n.startswith("also considered") and "parameters as sparse COO" in n for n in adv.notes)
    # GPT-2's lm_head is tied to transformer.wte: freezing the transformer would train nothing, no row
    assert not adv.by_kind("freeze")
    assert any(n.startswith("freezing: transformer (GPT2Model)") for n in adv.notes)
    # estimated figures are not called measured
    assert "(estimated on cpu, as memtorch.estimate())" in str(adv) and "measured" not in str(adv)
    # over the budget: sharding with plan's figures, CPU offload, 8-bit state (bitsandbytes' counts)
    small = memtorch.advise(model, batch, optimizer="adamw", budget="150 MiB", reserve=0, device="cpu")
    kinds = {s.kind for s in small} | {n.split(":")[0] for n in small.notes}
    assert {"cpu_offload", "optimizer_8bit"} <= kinds and ("sharding" in kinds)
    # the 8-bit row: estimate()'s step with bitsandbytes' AdamW in 8 bits as the printed line builds it (a
    # transformers model: the Trainer's optim='adamw_bnb_8bit'), its state counted by hand from bitsandbytes'
    # rules (uint8 state1/state2 and a float32 absmax per 256 elements from 4096 elements up, two float32
    # states below, two shared 256-entry float32 maps) and the Trainer's (nn.Embedding weights in float32:
    # wte, tied to lm_head, and wpe)
    (eight,) = small.by_kind("optimizer_8bit")
    est8 = memtorch.estimate(model, batch, optimizer="adamw_bnb_8bit", device="cpu")
    assert eight.before == adv.peak and eight.after == est8.peak < adv.peak
    assert eight.fits is (est8.peak <= 150 * 2**20)
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    by_hand = 2048 + sum(
        8 * p.numel() if id(p) in embeddings or p.numel() < 4096 else 2 * p.numel() + 8 * -(-p.numel() // 256)
        for p in dict.fromkeys(model.parameters())
    )
    assert est8.model_states["optimizer_state"] == by_hand
    assert memtorch.units.format(by_hand) in eight.detail and "adamw_bnb_8bit" in eight.detail


@pytest.mark.slow
def test_optimizer_by_name_instance_or_factory_agree():
    model = nn.Linear(100, 50)
    x = torch.ones(4, 100)
    by_name = cpu_advise(model, x, optimizer="adam")
    by_instance = cpu_advise(model, x, optimizer=torch.optim.Adam(model.parameters(), foreach=False))
    by_factory = cpu_advise(model, x, optimizer=lambda ps: torch.optim.Adam(ps, foreach=False))
    assert by_name.peak == by_instance.peak == by_factory.peak
    assert by_name.by_kind("optimizer_sgd")[0].saves == 2 * lin(100, 50) + 2 * 4


def test_sharding_row_is_plans_cheapest_fit_and_estimates_figure():
    # one answer per question: advise's sharding row is plan()'s best for the same configuration, and its
    # figure is estimate()'s for the configuration it names
    torch.manual_seed(0)
    model = blocks(n=4, d=256)
    x = torch.randn(64, 256)
    one = memtorch.estimate(model, x, device="cpu")

    def both(budget):
        adv = memtorch.advise(model, x, budget=budget, reserve=0, device="cpu")
        p = memtorch.plan(model, x, device_memory=budget, reserve=0, device="cpu",
                          precisions=["fp32", "bf16-mixed"], checkpointing=[None, "blocks"])  # fmt: skip
        return adv, p.best

    # one process misses it by a byte: plan's answer is one process under bf16 autocast, the mixed-precision
    # row's own figures, so no second row says it (the note does)
    adv, b = both(one.peak - 1)
    assert (b.world_size, b.precision, b.checkpointing) == (1, "bf16-mixed", None)
    assert not adv.by_kind("sharding")
    (mixed,) = adv.by_kind("autocast_bf16")
    assert mixed.after == b.peak
    said = ("sharding: not needed; memtorch.plan's cheapest configuration that fits is 1 process, bf16-mixed "
            f"(peak {memtorch.units.format(b.peak)}), the figures of the row '{mixed.title}'")
    assert said in adv.notes
    # half of it: only sharding fits
    adv, b = both(one.peak // 2)
    (row,) = adv.by_kind("sharding")
    assert b is not None and b.world_size > 1 and row.after == b.peak and row.fits
    assert row.group == "keeps the model"
    est = memtorch.estimate(model, (b.micro_batch, 256), device="cpu", precision=b.precision,
                            checkpointing=b.checkpointing, world_size=b.world_size, sharding=b.sharding)  # fmt: skip
    assert est.peak == b.peak
    # the rows that keep the model come first, in the order a user would try them
    kinds = [s.kind for s in adv if s.group == "keeps the model"]
    order = ["checkpointing", "autocast_bf16", "micro_batch", "sharding", "cpu_offload", "optimizer_8bit"]
    assert kinds == [k for k in order if k in kinds] and "sharding" in kinds
    assert not adv.by_kind("depth")  # removing layers is not advice unless asked for
    assert all(s.code.get("torch") for s in adv if s.group == "keeps the model")
    assert "torch: " in str(adv)  # the model is plain torch: its one-line changes are torch's


def test_model_states_alone_over_budget_skip_the_micro_batch_search_on_one_process_only():
    torch.manual_seed(0)
    model = blocks(n=4, d=256)
    x = torch.randn(64, 256)
    one = memtorch.estimate(model, x, device="cpu")
    states = sum(one.model_states[c] for c in ("parameter", "buffer", "gradient", "optimizer_state"))
    adv = memtorch.advise(model, x, budget=states - 1, reserve=0, device="cpu")
    assert any("the model states alone" in n for n in adv.notes) and not adv.by_kind("micro_batch")
    # sharded over 4 ranks, a rank holds a quarter of them: the smaller micro-batch is weighed
    four = memtorch.advise(
        model, x, budget=states - 1, reserve=0, device="cpu", world_size=4, sharding="zero3"
    )
    assert not any("the model states alone" in n for n in four.notes)


def test_lora_and_qlora_rows_are_estimates_of_the_wrapped_model_and_change_nothing():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    import copy

    import torch

    from memtorch import _quantize, models

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    before = {n: (p.data_ptr(), p.requires_grad) for n, p in model.named_parameters()}
    ids = ((2, 32), torch.long)
    batch = {"input_ids": ids, "labels": ids}
    a = memtorch.advise(model, batch, device="cpu", budget="64 MiB", reserve=0)
    rows = {s.kind: s for s in a.items}
    assert rows["lora"].group == rows["qlora"].group == "changes the training"
    # the model given is as it was: no adapter, no quantized layer, the same tensors
    assert {n: (p.data_ptr(), p.requires_grad) for n, p in model.named_parameters()} == before
    assert not any("lora" in n for n, _ in model.named_modules())
    # each row's figure is estimate()'s of the model wrapped as the row's code line wraps it
    spec = {"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
    wrapped = models.with_lora(copy.deepcopy(model), spec)
    assert rows["lora"].after == memtorch.estimate(wrapped, batch, device="cpu").peak
    q = models.with_lora(_quantize.apply(model, "nf4", double_quant=True), spec)
    assert rows["qlora"].after == memtorch.estimate(q, batch, device="cpu").peak
    assert rows["qlora"].after < rows["lora"].after < a.peak
    assert "target_modules=['q_proj', 'v_proj']" in rows["lora"].code["transformers"]
    assert isinstance(peft.LoraConfig(r=16), peft.LoraConfig)


def test_the_bf16_weights_row_estimated_takes_the_batch_in_bfloat16_as_the_measured_row_does():
    # a float32 Sequential given a float32 batch: the row's dry run failed ("mat1 and mat2 must have the same
    # dtype", the whole error quoted under "checked") where the measured row casts the batch; it is now the
    # estimate of that step, figure for figure
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x = torch.randn(32, 64)
    adv = memtorch.advise(model, x, optimizer="adam", device="cpu")
    assert not any("did not run" in n for n in adv.notes), adv.notes
    (bf,) = adv.by_kind("bf16_weights")
    est = memtorch.estimate(model, x.bfloat16(), optimizer="adam", device="cpu", precision="bf16-true")
    assert bf.basis.startswith("estimated") and bf.after == est.peak and bf.saves == adv.peak - est.peak
    assert bf.saves > 0 and x.dtype == torch.float32  # the caller's batch as it was


def test_the_bf16_weights_row_names_the_step_it_starts_from():
    # from a bf16-mixed step the weights are float32 under autocast: the row says so, not "in float32"
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
    )
    ids = ((2, 16), torch.long)
    batch = {"input_ids": ids, "labels": ids}
    (mixed,) = memtorch.advise(model, batch, device="cpu", precision="bf16-mixed").by_kind("bf16_weights")
    assert "with float32 weights under bfloat16 autocast, " in mixed.detail, mixed.detail
    (plain,) = memtorch.advise(model, batch, device="cpu").by_kind("bf16_weights")
    assert " in float32, " in plain.detail and "autocast" not in plain.detail, plain.detail


def test_a_change_that_raises_the_peak_is_not_called_a_small_saving():
    # seen in examples/will_it_fit.py: "each under 1% of the step peak (21.8 GiB): QLoRA ... (-2.2 GiB)"
    from types import SimpleNamespace

    from memtorch.estimator.advise import _considered

    rows = [SimpleNamespace(title="QLoRA", saves=-(2 << 30)), SimpleNamespace(title="sparse", saves=1536),
            SimpleNamespace(title="SGD", saves=4096), SimpleNamespace(title="8-bit", saves=-1024)]  # fmt: skip
    assert _considered(rows, "step peak", 100 << 30) == [
        "also considered, each saving under 1% of the step peak (100.0 GiB): SGD (4.0 KiB); sparse (1.5 KiB)",
        "also considered, each raising the step peak (100.0 GiB): QLoRA (+2.0 GiB); 8-bit (+1.0 KiB)",
    ]
    assert _considered(rows[1:3], "bytes held", 1 << 20) == [
        "also considered, each saving under 1% of the bytes held (1.0 MiB): SGD (4.0 KiB); sparse (1.5 KiB)"
    ]


@pytest.mark.slow
def test_micro_batch_row_skips_a_divisor_the_caching_allocators_segments_keep_from_fitting():
    """On cuda a micro-batch below fit()'s answer may not fit (the reserved figure falls back at larger
    batches): the row is the largest divisor of the batch whose own estimate fits, not the largest below
    the answer."""
    from test_fit import _ids as ids
    from test_fit import _tiny_llama

    model = _tiny_llama()
    at = {b: memtorch.estimate(model, ids(b), gpu="l4").reserved_peak for b in range(18, 33)}
    falls = [b for b in range(19, 33) if at[b] < at[b - 1]]
    assert falls, "no batch here whose reserved figure falls below the one before"
    budget = at[falls[0]]
    hole = falls[0] - 1  # does not fit, where a larger batch does
    assert at[hole] > budget
    batch = 2 * hole  # its largest divisor below fit()'s answer is the hole
    f = memtorch.fit(model, ids(batch), device_memory=budget, reserve=0, gpu="l4", max_value=batch - 1)
    assert hole < f.value < batch
    adv = memtorch.advise(model, ids(batch), budget=budget, reserve=0, gpu="l4")
    (row,) = adv.by_kind("micro_batch")
    fitting = [
        d
        for d in range(1, hole)
        if batch % d == 0 and memtorch.estimate(model, ids(d), gpu="l4").reserved_peak <= budget
    ]
    want = max(fitting)
    assert f"Micro-batches of {want} with {batch // want} gradient accumulation steps" in row.title, row.title
    assert row.fits and f"but {hole} does not" in row.detail, row.detail


def test_advise_for_a_gpu_by_name_judges_against_its_memory():
    # one answer per question: with gpu= and no budget, advise judged nothing ('-' in every row) while
    # fit(gpu=...) and plan(gpu=...) judge against the GPU's nominal memory; now the same budget, and the
    # note on the budget says where it came from; without inputs there is no step to judge (no budget)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x = torch.ones(64, 256)
    named = memtorch.advise(model, x, gpu="l4")
    sized = memtorch.advise(model, x, gpu="l4", budget="24 GiB")
    assert named.budget == sized.budget == 24 << 30
    assert [(s.title, s.after, s.fits) for s in named] == [(s.title, s.after, s.fits) for s in sized]
    (said,) = [n for n in named.notes if n.startswith("budget: the step as it is fits 24.0 GiB")]
    assert said.endswith("; 24.0 GiB is the L4 24GB's nominal memory (NVIDIA's specification; torch reports a "
                         "little less)"), said
    assert "nominal memory" not in next(n for n in sized.notes if n.startswith("budget:"))
    assert memtorch.advise(model, gpu="l4").budget is None
    with pytest.raises(memtorch.MemtorchError, match="no memory size known for gpu='a100'.*pass budget="):
        memtorch.advise(model, x, gpu="a100")
