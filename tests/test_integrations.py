"""track() in the loops of the frameworks: optimizer.step(closure), wrapped optimizers, an optimizer
made inside the block, a batch given as kwargs; memtorch.integrations' callbacks in real
transformers and Lightning Trainers (skipped without them; CI installs the extras hf, lightning).

Truths: the Adam/AdamW state by hand (two float32 tensors per parameter, the size of the
parameter, and a 4-byte ``step``) and from the optimizer's own tensors; the optimizer phase of
``step(closure)`` against a plain loop of the same model (zero_grad, forward, backward, step),
which the issue measured right (it matched the profiler to the byte).
"""

import sys

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import memtorch  # noqa: E402
from memtorch import tracking  # noqa: E402

EXACT = sys.platform.startswith("linux") and memtorch.cpu.exact()


def _optional(name):
    """The framework, imported at collection (its import takes seconds), or None."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


transformers = _optional("transformers")
accelerate = _optional("accelerate")
pl = _optional("pytorch_lightning")
needs_hf = pytest.mark.skipif(
    transformers is None or accelerate is None, reason="needs transformers and accelerate (extra hf)"
)
# Lightning's own deprecation warnings (torch's pytree) are not this test's concern
_PL_MARKS = (
    pytest.mark.skipif(pl is None, reason="needs pytorch-lightning (extra lightning)"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
)


def needs_pl(test):
    for mark in _PL_MARKS:
        test = mark(test)
    return test
exact_only = pytest.mark.skipif(not EXACT, reason="needs exact CPU counters (the event log)")

D_IN, D_H = 64, 256
P_BYTES = (D_IN * D_H + D_H + D_H * D_IN + D_IN) * 4  # 132,352: the MLP's weights and biases, float32
# exp_avg and exp_avg_sq per parameter, a float32 step per parameter (4 of them)
ADAM_STATE = 2 * P_BYTES + 4 * 4


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_H), nn.ReLU(), nn.Linear(D_H, D_IN))


def batches(n=3, b=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, D_IN, generator=g) for _ in range(n)]


def no_hooks(model, optimizer=None):
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as optim_module

    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._forward_pre_hooks_with_kwargs
    assert not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
    assert not optim_module._global_optimizer_pre_hooks and not optim_module._global_optimizer_post_hooks
    if optimizer is not None:
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert tracking._debug_leftovers() == []


def phases(report):
    return {k: (p.calls, p.delta, p.peak_above_start) for k, p in report.phases.items()}


def plain_loop(model, opt, xs):
    with memtorch.track(model, optimizer=opt, leaks=False) as t:
        for x in xs:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            t.step()
    return t.report


def closure_loop(model, opt, xs):
    with memtorch.track(model, optimizer=opt, leaks=False) as t:
        for x in xs:

            def closure():
                opt.zero_grad()
                loss = model(x).sum()
                loss.backward()
                return loss

            opt.step(closure)
            t.step()
    return t.report


@pytest.fixture(params=["event log", "counter scopes"])
def hook_path(request, monkeypatch):
    """Both ways track() runs its hooks: the C marks with the event log (exact CPU counters on
    Linux), and the Python hooks with a counter scope per phase (CUDA, other platforms)."""
    if request.param == "event log":
        if not EXACT:
            pytest.skip("needs exact CPU counters (the event log)")
    else:  # tracking.py takes the event log on Linux only: it sees another platform
        monkeypatch.setattr(tracking, "sys", _OtherPlatform())
    return request.param


class _OtherPlatform:
    platform = "elsewhere"

    def __getattr__(self, name):
        return getattr(sys, name)


# --- row 7: optimizer.step(closure) -------------------------------------------------------


def test_closure_step_phases_are_the_plain_loops(hook_path):
    xs = batches()
    model, opt = mlp(), None
    opt = torch.optim.Adam(model.parameters())
    plain = plain_loop(model, opt, xs)
    model2 = mlp()
    opt2 = torch.optim.Adam(model2.parameters())
    closed = closure_loop(model2, opt2, xs)
    no_hooks(model2, opt2)
    p, c = phases(plain), phases(closed)
    # one optimizer call per step (the update resumed after the closure is the same call)
    assert c["optimizer"][0] == p["optimizer"][0] == 3
    assert c["forward"][0] == c["backward"][0] == 3
    if EXACT:
        # the state is made in the first update, by hand; the later updates keep their bytes
        assert p["optimizer"][1] == ADAM_STATE
        assert c["optimizer"][1] == ADAM_STATE
        # the update's own peak (state + temporaries) is the plain loop's, not 0 B in backward
        assert c["optimizer"][2] == p["optimizer"][2] > ADAM_STATE
        assert c["backward"][2] == p["backward"][2]


@exact_only
def test_closure_step_at_peak_names_the_update():
    xs = batches(2)
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    plain = plain_loop(model, opt, xs).at_peak
    model2 = mlp()
    opt2 = torch.optim.Adam(model2.parameters())
    closed = closure_loop(model2, opt2, xs).at_peak
    by = closed.by_kind()
    assert by["optimizer state"] == ADAM_STATE
    owners = {(o.name, o.kind): o.nbytes for o in closed.owners}
    # the update's temporaries are the optimizer's, as in the plain loop (they were "backward temporaries")
    assert owners[("optimizer temporaries, not its state", "temporary")] == {
        (o.name, o.kind): o.nbytes for o in plain.owners
    }[("optimizer temporaries, not its state", "temporary")]
    assert owners.get(("backward temporaries, not gradients", "temporary"), 0) < 64


def test_lbfgs_calls_its_closure_many_times(hook_path):
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3, history_size=2)
    x = batches(1)[0]
    calls = []
    with memtorch.track(model, optimizer=opt) as t:
        for _ in range(2):

            def closure():
                calls.append(1)
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    no_hooks(model, opt)
    p = phases(t.report)
    assert p["optimizer"][0] == 2  # two steps
    assert p["forward"][0] == p["backward"][0] == len(calls) >= 4  # every closure call's forward and backward


def test_marks_closure_hook_and_resume():
    from memtorch import _C

    marks = _C.ModuleMarks({}, 0, 1 << 24, [], torch.is_grad_enabled)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    seen = []
    for name in ("closure_hook", "in_backward"):  # both setters take a callable or None, nothing else
        with pytest.raises(TypeError, match=name):
            setattr(marks, name, 3)
        with pytest.raises(TypeError, match=name):
            delattr(marks, name)
        assert getattr(marks, name) is None  # a refused value leaves the slot as it was
    marks.closure_hook = lambda args, kwargs: seen.append((args, kwargs))
    assert marks.opt_pre(opt, (opt,), {}) is None and seen == []  # a step without arguments: no Python
    marks.opt_post(opt, (opt,), {})
    marks.opt_pre(opt, (opt, print), {})
    assert seen == [((opt, print), {})]
    marks.end_phase()  # the closure began
    marks.resume_optimizer()  # ... and returned
    assert marks.phase_code == 3
    marks.opt_post(opt, (opt, print), {})
    assert marks.phases[2][0] == 2  # two steps, the resumed update no call of its own
    marks.closure_hook = None


class _RecordingSGD(torch.optim.SGD):
    """SGD that records the closure its step() receives (after the step pre-hooks)."""

    received = []

    def step(self, closure=None):
        self.received.append(closure)
        return super().step(closure)


def test_what_the_optimizer_receives():
    model = mlp()
    opt = _RecordingSGD(model.parameters(), lr=0.1)
    opt.received = []
    x = batches(1)[0]

    def closure():
        loss = model(x).sum()
        loss.backward()
        return loss

    with memtorch.track(model, optimizer=opt):
        opt.step()
        opt.step(closure=None)
        opt.step(closure)
    opt.step(closure)  # after the block: the user's own closure
    no_hooks(model, opt)
    got = opt.received
    assert got[0] is None and got[1] is None  # no closure made up
    assert got[2] is not closure and callable(got[2])  # wrapped inside the block only
    assert got[3] is closure


# --- row 8: wrapped optimizers ------------------------------------------------------------


class _Wrapper:
    """A wrapper as frameworks write them: the torch optimizer in .optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)


class _SubclassWrapper(torch.optim.Optimizer):
    """accelerate's AcceleratedOptimizer's shape: an Optimizer subclass that never runs Optimizer.__init__."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)


class _Hollow(torch.optim.Optimizer):
    def __init__(self):
        pass


@pytest.mark.parametrize("wrap", [_Wrapper, _SubclassWrapper])
def test_wrapped_optimizer_is_unwrapped(wrap):
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    wrapped = wrap(opt)
    with memtorch.track(model, optimizer=wrapped) as t:
        model(batches(1)[0]).sum().backward()
        wrapped.step()
    no_hooks(model, opt)
    assert t.report.phases["optimizer"].calls == 1
    if EXACT:
        assert t.report.phases["optimizer"].delta == ADAM_STATE


@needs_hf
def test_accelerated_optimizer_is_unwrapped():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    wrapped = accelerate.Accelerator(cpu=True).prepare_optimizer(opt)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    with memtorch.track(model, optimizer=wrapped) as t:  # AttributeError '_optimizer_step_pre_hooks' before
        model(batches(1)[0]).sum().backward()
        wrapped.step()
    no_hooks(model, opt)
    assert t.report.phases["optimizer"].calls == 1


@pytest.mark.skipif(pl is None, reason="needs pytorch-lightning (extra lightning)")
def test_lightning_optimizer_is_unwrapped():
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    assert tracking._unwrap_optimizer(pl.core.optimizer.LightningOptimizer(opt)) is opt


@pytest.mark.parametrize(
    "bad, words",
    [
        (object(), "expects a torch.optim.Optimizer, got object (a wrapper"),
        (_Hollow(), "never ran Optimizer.__init__"),
    ],
)
def test_not_an_optimizer_is_refused_with_no_hook_left(bad, words):
    model = mlp()
    with pytest.raises(TypeError, match=words.replace("(", r"\(")):
        with memtorch.track(model, optimizer=bad):
            pass
    t = memtorch.track(model)
    with t:
        with pytest.raises(TypeError, match="watch"):
            t.watch(optimizer=bad)
    no_hooks(model)


# --- row 9: an optimizer made in the block, a batch given as kwargs ------------------------


def test_optimizer_made_inside_the_block_is_found(hook_path):
    model = mlp()
    other = nn.Linear(4, 4)
    xs = batches(2)
    with memtorch.track(model) as t:
        foreign = torch.optim.SGD(other.parameters(), lr=0.1)  # steps no parameter of the model
        opt = torch.optim.AdamW(model.parameters())
        for x in xs:
            model(x).sum().backward()
            other(torch.ones(1, 4)).sum().backward()
            foreign.step()
            opt.step()
            opt.zero_grad()
            t.step()
    no_hooks(model, opt)
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values())
    assert state == ADAM_STATE  # the tensors' own sizes, and by hand
    p = phases(t.report)
    assert p["optimizer"][0] == 2  # AdamW's steps only, not the SGD's of the other model
    if EXACT:
        assert p["optimizer"][1] == ADAM_STATE
    if hook_path == "event log":
        assert t.report.at_peak.by_kind()["optimizer state"] == ADAM_STATE  # was "backward temporaries"
    # the next block looks again: nothing of this one's optimizer is kept
    assert t._optimizer is None


def test_optimizer_found_after_watch():
    model = mlp()
    with memtorch.track() as t:  # the pytest fixture's way: the model given once the block is open
        t.watch(model)
        opt = torch.optim.Adam(model.parameters())
        model(batches(1)[0]).sum().backward()
        opt.step()
    no_hooks(model, opt)
    assert t.report.phases["optimizer"].calls == 1
    if EXACT:
        assert t.report.phases["optimizer"].delta == ADAM_STATE


class _KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D_IN)

    def forward(self, input_ids=None, mask=None):
        return self.lin(input_ids) * mask


@exact_only
def test_batch_given_as_kwargs_is_named_input():
    # the batch is named at the peak only if its allocation was counted: start counting before it
    # is made (run alone, the block's own start would come after the batch, and it would be unseen)
    memtorch.cpu.start()
    model = _KwargsModel()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randn(32, D_IN, generator=g), "mask": torch.ones(32, D_IN)}
    with memtorch.track(model) as t:
        model(**batch).sum().backward()
    no_hooks(model)
    named = {o.name: o.nbytes for o in t.report.at_peak.owners if o.kind == "input"}
    assert named == {"input_ids": 32 * D_IN * 4, "mask": 32 * D_IN * 4}  # by hand: float32
    # the leak scan's "current batch" is these storages too
    assert len(t._marks.last_inputs if t._marks is not None else []) in (0, 2)


# --- the callbacks, in the real frameworks ----------------------------------------------


def _tiny_gpt2():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32)
    return transformers, transformers.GPT2LMHeadModel(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _hf_trainer(transformers, model, out, callbacks=(), **more):
    kw = dict(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=4, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    args = transformers.TrainingArguments(**{**kw, **more})
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=list(callbacks))


class _Counters:
    """The CPU counters read directly (memtorch.cpu, not the block): the bytes held and the peak since
    the last boundary, at the block's start and at each step's end (the global peak reset there)."""

    def __init__(self):
        self.held, self.peaks = [], []

    def start(self):
        memtorch.cpu.reset_peak()
        self.held.append(memtorch.cpu.allocated())

    def boundary(self):
        self.peaks.append(memtorch.cpu.peak())
        self.held.append(memtorch.cpu.allocated())
        memtorch.cpu.reset_peak()

    def expected(self, lo, hi, warmup=1):
        """The figures of steps lo+1..hi (1-based), by hand from the direct reads."""
        from fractions import Fraction

        out = {
            "memtorch/peak_bytes": max(self.peaks[lo:hi]),
            "memtorch/peak_above_step_start_bytes": max(self.peaks[i] - self.held[i] for i in range(lo, hi)),
            "memtorch/allocated_bytes": self.held[hi],
        }
        if hi > warmup:
            rate = Fraction(self.held[hi] - self.held[warmup], hi - warmup)
            out["memtorch/leak_bytes_per_step"] = int(rate) if rate.denominator == 1 else float(rate)
        return out


def _state_bytes(opt):
    opt = getattr(opt, "optimizer", opt)
    tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(v.untyped_storage().nbytes() for v in tensors)


def _adamw_by_hand(model):
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights once
    return sum(2 * p.untyped_storage().nbytes() + 4 for p in params)


@needs_hf
@pytest.mark.slow  # a Trainer's start: 1-3 s on a busy 2-core machine
def test_transformers_callback(tmp_path, capsys):
    transformers, model = _tiny_gpt2()
    from memtorch.integrations.transformers import MemoryCallback

    cb = MemoryCallback(leak="1 MiB")
    trainer = _hf_trainer(transformers, model, tmp_path, [cb])
    trainer.train()
    no_hooks(model)
    r = cb.report
    assert cb.tracker is None and r.steps == 3 and r.leak is not None
    assert "memtorch.track on cpu" in capsys.readouterr().out
    state = _state_bytes(trainer.optimizer)
    assert state == _adamw_by_hand(model)
    p = phases(r)
    assert p["optimizer"][0] == p["forward"][0] == p["backward"][0] == 3
    if EXACT:
        assert p["optimizer"][1] == state  # the AcceleratedOptimizer was unwrapped: AdamW's own steps
        assert r.at_peak.by_kind()["optimizer state"] == state
        inputs = {o.name for o in r.at_peak.owners if o.kind == "input"}
        assert {"input_ids", "labels"} <= inputs  # model(**batch)


def _hf_capture(transformers, counters):
    class Capture(transformers.TrainerCallback):
        """Stands for a report_to backend: reads the logs at on_log, the counters at each step's end
        (memtorch's on_step_end runs before: it moved to the front of the list)."""

        logs, ended = [], []

        def on_step_end(self, args, state, control, **kw):
            counters.boundary()

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs))

        def on_train_end(self, args, state, control, **kw):
            self.ended.append(state.global_step)

    return Capture()


def _hf_begin(transformers, counters):
    class Begin(transformers.TrainerCallback):
        """After memtorch's in the list: reads the counters once its block is open."""

        def on_train_begin(self, args, state, control, **kw):
            counters.start()

    return Begin()


@needs_hf
@exact_only
@pytest.mark.slow  # a Trainer's start: 1-3 s on a busy 2-core machine
def test_transformers_callback_logs(tmp_path, capsys):
    transformers, model = _tiny_gpt2()
    from memtorch.integrations import LOG_NAMES
    from memtorch.integrations.transformers import MemoryCallback

    counters = _Counters()
    seen = _hf_capture(transformers, counters)  # before memtorch's in the list, as the reporting callbacks are
    cb = MemoryCallback(print_report=False)
    begin = _hf_begin(transformers, counters)
    trainer = _hf_trainer(transformers, model, tmp_path, [seen, cb, begin], logging_strategy="steps", logging_steps=2)
    order = list(trainer.callback_handler.callbacks)
    trainer.train()
    no_hooks(model)
    assert trainer.callback_handler.callbacks == order  # memtorch back in its place
    mine = [{k: v for k, v in logs.items() if k.startswith("memtorch/")} for logs in seen.logs]
    # steps 1-2 logged at step 2, step 3 with the end of training's log; the reporting callback saw them
    assert mine == [counters.expected(0, 2), counters.expected(2, 3)]
    # the CPU: no reserved figure, and every peak exact
    assert set(mine[1]) == {n for n in LOG_NAMES if "reserved" not in n and "at_least" not in n}
    # in state.log_history's entries too, and on the console (PrinterCallback, after memtorch's)
    history = [{k: v for k, v in e.items() if k.startswith("memtorch/")} for e in trainer.state.log_history]
    assert history == mine
    assert "'memtorch/peak_bytes': " in capsys.readouterr().out
    # the leak rate logged last is the report's; the peak logged, the report's step peaks
    r = cb.report
    assert mine[1]["memtorch/leak_bytes_per_step"] == r.leak.per_step
    assert max(m["memtorch/peak_bytes"] for m in mine) == max(p for p, _ in r.step_series)
    assert seen.ended == [3]  # its on_train_end ran


def test_logged_figures_on_cuda(monkeypatch):
    # the callbacks' figures on CUDA: torch.cuda's counters through memtorch.cuda (a faked device,
    # as tests/test_cuda_logic.py's: blocks of 512 B, segments of 2 MiB), reserved at the interval's end
    from fractions import Fraction

    from memtorch import cuda as mcuda
    from memtorch.integrations import Session
    from test_cuda_logic import FakeDevice

    dev = FakeDevice()
    monkeypatch.setattr(mcuda, "_available", lambda: True)
    monkeypatch.setattr(mcuda, "_device_count", lambda: 1)
    monkeypatch.setattr(mcuda, "_current_device", lambda: 0)
    monkeypatch.setattr(mcuda, "_memory_stats", dev.stats)
    monkeypatch.setattr(mcuda, "_counters", dev.counters)
    session = Session(print_report=False)
    t = session.tracker = memtorch.track(device="cuda")
    t.__enter__()
    try:
        dev.alloc(1000)  # 1,024 B held from before the first step
        t.step()
        dev.alloc(3 << 20)  # step 2: 3 MiB, 1 MiB of it freed again
        dev.free(1 << 20)
        t.step()
        first = session.figures()
        dev.alloc(4 << 20)  # step 3: a new peak, all of it freed
        dev.free(4 << 20)
        t.step()
        second = session.figures()
        assert session.figures() == {}  # no step since
        dev.alloc(1 << 20)  # step 4: below step 3's peak, which torch keeps (and memtorch never resets)
        dev.free(1 << 20)
        t.step()
        third = session.figures()
    finally:
        session.close()
    held = 1024 + (2 << 20)
    assert first == {
        "memtorch/peak_bytes": 1024 + (3 << 20),
        "memtorch/peak_above_step_start_bytes": 3 << 20,
        "memtorch/allocated_bytes": held,
        "memtorch/leak_bytes_per_step": 2 << 20,  # step 2 (step 1 is the warm-up)
        "memtorch/reserved_bytes": 4 << 20,  # 3 MiB and 1,024 B in segments of 2 MiB
    }
    assert second == {
        "memtorch/peak_bytes": held + (4 << 20),
        "memtorch/peak_above_step_start_bytes": 4 << 20,
        "memtorch/allocated_bytes": held,
        "memtorch/leak_bytes_per_step": 1 << 20,  # 2 MiB over the 2 judged steps
        "memtorch/reserved_bytes": 8 << 20,  # the allocator keeps its segments
    }
    assert dev.reserved == 8 << 20
    # the device's counters cannot tell how high step 4 went (1 MiB above its start): its figures are lower
    # bounds, the bytes seen at its boundaries, logged under their own names
    assert third == {
        "memtorch/peak_at_least_bytes": held,
        "memtorch/peak_above_step_start_at_least_bytes": 0,
        "memtorch/allocated_bytes": held,
        "memtorch/leak_bytes_per_step": float(Fraction(2 << 20, 3)),  # 2 MiB over 3 judged steps, not whole
        "memtorch/reserved_bytes": 8 << 20,
    }


@needs_hf
@pytest.mark.slow  # a Trainer's start: 1-3 s on a busy 2-core machine
def test_transformers_callback_closed_after_a_failed_train(tmp_path):
    transformers, model = _tiny_gpt2()
    from memtorch.integrations.transformers import MemoryCallback

    class Fails(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                raise RuntimeError("step 2 failed")

    cb = MemoryCallback(print_report=False)
    trainer = _hf_trainer(transformers, model, tmp_path, [cb, Fails()])
    order = list(trainer.callback_handler.callbacks)
    with pytest.raises(RuntimeError, match="step 2 failed"):
        trainer.train()
    # transformers calls no callback when training raises: the block is open, memtorch first in the list
    assert cb.tracker is not None and trainer.callback_handler.callbacks[0] is cb
    cb.close()
    assert cb.tracker is None and cb.report is None
    assert trainer.callback_handler.callbacks == order
    no_hooks(model)


@needs_hf
@pytest.mark.slow  # a Trainer's start: 1-3 s on a busy 2-core machine
def test_transformers_trainer_inside_track(tmp_path):
    transformers, model = _tiny_gpt2()
    trainer = _hf_trainer(transformers, model, tmp_path)
    with memtorch.track(model) as t:
        trainer.train()
    no_hooks(model)
    state = _state_bytes(trainer.optimizer)
    p = phases(t.report)
    assert p["optimizer"][0] == 3
    if EXACT:
        assert p["optimizer"][1] == state
        assert t.report.at_peak.by_kind()["optimizer state"] == state  # was filed as backward temporaries


@needs_hf
@pytest.mark.slow  # a Trainer's start: 1-3 s on a busy 2-core machine
def test_transformers_callback_budget(tmp_path):
    transformers, model = _tiny_gpt2()
    from memtorch.integrations.transformers import MemoryCallback

    with pytest.raises(ValueError, match="size|unit|parse"):
        MemoryCallback(peak="lots")
    cb = MemoryCallback(peak="1 KiB", print_report=False)
    after = _hf_capture(transformers, _Counters())
    trainer = _hf_trainer(transformers, model, tmp_path, [cb, after])
    order = list(trainer.callback_handler.callbacks)
    with pytest.raises(memtorch.BudgetExceeded, match="peak .* exceeds budget 1.0 KiB") as e:
        trainer.train()
    no_hooks(model)
    assert cb.report is not None
    # memtorch's on_train_end ran last: the callbacks after it in the list ended first
    assert after.ended == [3] and trainer.callback_handler.callbacks == order
    assert str(e.value).count("Counting began") <= 1  # one caveat, once


def _lightning():
    import logging

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return pl


def _lit_module(pl, fail_at=None):
    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            if i == fail_at:
                raise RuntimeError("training_step failed")
            return self(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

    return Lit()


def _fit(pl, module, callbacks=()):
    data = torch.utils.data.TensorDataset(torch.cat(batches(3)))
    trainer = pl.Trainer(
        max_epochs=1, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
    return trainer


@needs_pl
def test_lightning_callback_phases_are_the_plain_loops():
    pl = _lightning()
    from memtorch.integrations.lightning import MemoryCallback

    cb = MemoryCallback(print_report=False)
    module = _lit_module(pl)
    trainer = _fit(pl, module, [cb])
    no_hooks(module, trainer.optimizers[0])
    model = mlp()
    plain = plain_loop(model, torch.optim.Adam(model.parameters()), batches(3))
    r = cb.report
    p, q = phases(r), phases(plain)
    assert r.steps == 3 and p["optimizer"][0] == 3
    if EXACT:
        assert p["optimizer"][1] == ADAM_STATE  # 0 B before: the update was filed as backward
        assert p["optimizer"][2] == q["optimizer"][2]
        owners = {(o.name, o.kind): o.nbytes for o in r.at_peak.owners}
        assert owners.get(("backward temporaries, not gradients", "temporary"), 0) < 64


class _Split(nn.Module):
    """mlp()'s layers as three parts a training_step can call one by one."""

    def __init__(self):
        super().__init__()
        seq = mlp()
        self.a, self.b, self.c = seq[0], seq[1], seq[2]


def _lit_styled(pl, style):
    """A LightningModule with no forward of its own: its training_step calls self.model(x), its parts
    one by one ("parts"), or steps by hand (manual optimisation: zero_grad first, as the plain loop)."""

    class Styled(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _Split() if style == "parts" else mlp()
            self.automatic_optimization = style != "manual"

        def training_step(self, batch, i):
            x = batch[0]
            if style == "parts":
                m = self.model
                return m.c(m.b(m.a(x))).sum()
            if style == "manual":
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(self.model(x).sum())
                opt.step()
                return None
            return self.model(x).sum()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

    return Styled()


def _rows(report, under=""):
    """{name below the module ``under`` ("" for itself): (calls, activation_bytes, peak_above_start)}."""
    out = {}
    for r in report.modules:
        if not under or r.name == under or r.name.startswith(under + "."):
            out[r.name[len(under):].lstrip(".")] = (r.calls, r.activation_bytes, r.peak_above_start)
    return out


@needs_pl
@pytest.mark.parametrize("style", ["self.model", "parts", "manual"])
def test_lightning_any_style_is_the_plain_loop(style, hook_path):
    # a training_step that never calls the LightningModule itself: the forward pass is the first
    # module of the model that runs (was: no forward or backward phase, and module rows summed over
    # the steps, since the root's forwards, which they are averaged over, were 0)
    pl = _lightning()
    from memtorch.integrations.lightning import MemoryCallback

    cb = MemoryCallback(print_report=False)
    module = _lit_styled(pl, style)
    _fit(pl, module, [cb])
    no_hooks(module)
    model = mlp()
    plain = plain_loop(model, torch.optim.Adam(model.parameters()), batches(3))
    r = cb.report
    p, q = phases(r), phases(plain)
    assert r.steps == 3
    # one forward pass, one backward, one update per step (the parts' three calls are one pass)
    assert {k: v[0] for k, v in p.items()} == {"forward": 3, "backward": 3, "optimizer": 3}
    assert next(m for m in r.modules if m.name == "").calls == 0  # the LightningModule never ran
    names = {"0": "a", "1": "b", "2": "c"} if style == "parts" else {k: k for k in "012"}
    mine = _rows(r, "model")
    theirs = {names[k]: v for k, v in _rows(plain).items() if k in names}
    if not EXACT and hook_path == "counter scopes":
        assert {k: v[0] for k, v in mine.items() if k in theirs} == {k: v[0] for k, v in theirs.items()}
        return
    # per forward pass, as a plain step's: not the sum over the 3 steps
    assert {k: v for k, v in mine.items() if k in theirs} == theirs
    if style != "parts":
        assert mine[""] == _rows(plain)[""]  # self.model is the plain loop's root
        assert p["forward"] == q["forward"]
    assert p["optimizer"] == q["optimizer"]
    if style == "manual":  # zero_grad before the forward, as the plain loop (Lightning's own closure
        # zeroes the gradients after the forward: in the backward phase, a delta 2 x 132,352 B lower)
        assert p["backward"] == q["backward"]
    else:
        # Lightning's closure zeroes the gradients after the forward: in the backward phase, where steps
        # 2 and 3 free them; "parts": the first layer's output is freed by training_step's own code
        # between two calls, after the pass's first part (the plain loop frees it inside its root)
        freed = 2 * P_BYTES + (3 * 64 * D_H * 4 if style == "parts" else 0)
        assert p["forward"][1] == q["forward"][1] + freed - 2 * P_BYTES
        # and keeps a detached copy of the loss (ClosureResult.loss, one float32) with a few more
        # scalars of its own, made after the forward: 4 B in the backward's peak, 24 B in its delta
        assert p["backward"] == (3, q["backward"][1] - freed + 24, q["backward"][2] + 4)


@needs_pl
@exact_only
def test_lightning_callback_logs():
    pl = _lightning()
    from memtorch.integrations.lightning import MemoryCallback

    counters = _Counters()

    class Capture(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            counters.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            counters.boundary()

    class Logger(pl.loggers.logger.Logger):
        name, version = "capture", 0

        def __init__(self):
            super().__init__()
            self.calls = []

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, {k: v for k, v in metrics.items() if k.startswith("memtorch/")}))

    cb = MemoryCallback(print_report=False)
    module = _lit_styled(pl, "self.model")
    data = torch.utils.data.TensorDataset(torch.cat(batches(5)))
    trainer = pl.Trainer(
        max_epochs=1, callbacks=[cb, Capture()], logger=(log := Logger()), log_every_n_steps=2, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
    no_hooks(module)
    calls = [c for c in log.calls if c[1]]
    # every 2 steps, and the 5th at the end of training
    assert calls == [(2, counters.expected(0, 2)), (4, counters.expected(2, 4)), (5, counters.expected(4, 5))]
    assert calls[-1][1]["memtorch/leak_bytes_per_step"] == cb.report.leak.per_step


@needs_pl
def test_lightning_fit_inside_track():
    pl = _lightning()
    module = _lit_module(pl)
    with memtorch.track(module) as t:  # the optimizer is made by fit(): found at its first step
        trainer = _fit(pl, module)
    no_hooks(module, trainer.optimizers[0])
    model = mlp()
    plain = plain_loop(model, torch.optim.Adam(model.parameters()), batches(3))
    p, q = phases(t.report), phases(plain)
    assert p["optimizer"][0] == 3
    if EXACT:
        assert p["optimizer"][1] == ADAM_STATE and p["optimizer"][2] == q["optimizer"][2]


@needs_pl
def test_lightning_callback_closes_on_exception():
    pl = _lightning()
    from memtorch.integrations.lightning import MemoryCallback

    cb = MemoryCallback(print_report=False)
    module = _lit_module(pl, fail_at=1)
    with pytest.raises(RuntimeError, match="training_step failed"):
        _fit(pl, module, [cb])
    assert cb.tracker is None and cb.report is None
    no_hooks(module)


def _fresh_process(code):
    """Run ``code`` in a new Python (counting not begun: no memtorch block ran there yet); its stdout's last line."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


_FRESH_STEP = """
import json, torch, memtorch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(64, 64)
model(x).sum().backward()
opt.step()  # gradients and Adam's state, made before counting began
assert not memtorch.cpu.installed()
with memtorch.track(model, optimizer=opt) as t:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
r = t.report
print(json.dumps([r.start, r.at_peak.by_kind(), r.caveats, memtorch.cpu.allocated()]))
"""


@exact_only
def test_block_counts_from_what_the_model_and_optimizer_hold():
    # the counters begin with the first block: what the model and optimizer held before (made before
    # counting began) was not counted: start 0 B, no parameter at the peak, their frees unseen
    import json

    start, kinds, caveats, after = json.loads(_fresh_process(_FRESH_STEP))
    # by hand: parameters, gradients, exp_avg and exp_avg_sq the size of the parameters, 4 float32 steps
    assert start == 4 * P_BYTES + 4 * 4 == P_BYTES + P_BYTES + ADAM_STATE
    assert kinds["parameter"] == P_BYTES and kinds["optimizer_state"] == ADAM_STATE
    assert kinds["gradient"] == P_BYTES  # the new ones (zero_grad freed the old: a free seen)
    assert after == start  # the same storages held again, the old gradients' frees counted
    assert any(f"the {memtorch.units.format(start)} held then by the model and optimizer given" in c for c in caveats)
    assert not any("free(s) of memory allocated before counting began" in c for c in caveats)


@exact_only
def test_block_given_only_the_optimizer_counts_from_its_parameters_and_state():
    # the same step with track(optimizer=opt): the parameters (and their gradients) are the optimizer's
    # too, so the block counts from them as it does from the model's (was: start = Adam's state alone,
    # no parameter at the peak, its first block walking the state at every open)
    import json

    code = _FRESH_STEP.replace("memtorch.track(model, optimizer=opt)", "memtorch.track(optimizer=opt)")
    assert code != _FRESH_STEP
    start, kinds, caveats, after = json.loads(_fresh_process(code))
    assert start == P_BYTES + P_BYTES + ADAM_STATE  # parameters, gradients, exp_avg, exp_avg_sq, steps
    assert kinds["parameter"] == P_BYTES and kinds["optimizer_state"] == ADAM_STATE
    assert kinds["gradient"] == P_BYTES
    assert after == start
    assert any(f"the {memtorch.units.format(start)} held then by the model and optimizer given" in c for c in caveats)


@needs_hf
@exact_only
@pytest.mark.slow  # a new Python with transformers: 5-10 s
def test_transformers_callback_counts_the_model(tmp_path):
    # the callback's block in a new process: the model was made before counting began (was: start 0 B,
    # at_peak with no parameter)
    import json

    here = str(__import__("pathlib").Path(__file__).parent)
    code = f"""
import sys, json
sys.path.insert(0, {here!r})
import test_integrations as T, memtorch
from memtorch.integrations.transformers import MemoryCallback
transformers, model = T._tiny_gpt2()
own = {{p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in [*model.parameters(), *model.buffers()]}}
params = sum({{p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}}.values())
cb = MemoryCallback(print_report=False)
T._hf_trainer(transformers, model, {str(tmp_path)!r}, [cb]).train()
print(json.dumps([cb.report.start, sum(own.values()), params, cb.report.at_peak.by_kind()]))
"""
    start, own, params, kinds = json.loads(_fresh_process(code))
    assert start == own  # the parameters and buffers, by their own nbytes (the optimizer's state comes later)
    assert kinds["parameter"] == params


def test_importing_memtorch_imports_no_framework():
    import subprocess

    code = (
        "import sys, memtorch, memtorch.integrations; "
        "print(sorted(m for m in ('transformers', 'pytorch_lightning', 'lightning', 'accelerate') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@needs_pl
def test_lightning_callback_reports_an_out_of_memory_error(capsys):
    # a real failing allocation in training_step (c10's "can't allocate memory"): on_exception closes the
    # block with the error, which gets the report of who held what (issue 37 item 1), printed once
    pl = _lightning()
    from memtorch.integrations.lightning import MemoryCallback

    class Fuse(torch.nn.Module):
        armed = False

        def forward(self, x):
            if self.armed:
                x.new_empty(2**50)  # 4 PiB of float32: no allocator gives it
            return x

    class Bomb(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.fuse = Fuse()

        def training_step(self, batch, i):
            self.fuse.armed = i == 1
            return self.fuse(self.net(batch[0])).sum()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

    memtorch.cpu.start()
    cb = MemoryCallback(print_report=False)
    module = Bomb()
    with pytest.raises(RuntimeError, match="can't allocate memory") as err:
        _fit(pl, module, [cb])
    r = err.value.memtorch_report
    assert isinstance(r, memtorch.OomReport) and r.device == "cpu" and r.requested == 2**52
    assert (r.phase, r.module) == ("forward", "fuse (Fuse)")
    # at the failure: the parameters, and after step 0 their gradients' place taken by Adam's state
    params = sum(p.untyped_storage().nbytes() for p in module.parameters())
    kinds = r.by_kind()
    assert kinds["parameter"] == params
    assert kinds["optimizer_state"] >= 2 * params  # exp_avg and exp_avg_sq (and the step counts)
    assert capsys.readouterr().err.count("memtorch: out of memory on cpu") == 1
    assert cb.tracker is None and cb.report is None
    no_hooks(module)


@needs_hf
@pytest.mark.slow  # a Trainer's start: 1-3 s on a busy 2-core machine
def test_transformers_callback_close_with_the_error_reports_out_of_memory(tmp_path, capsys):
    transformers, model = _tiny_gpt2()
    from memtorch.integrations.transformers import MemoryCallback

    class Bomb(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 2:
                next(model.parameters()).new_empty(2**50)

    memtorch.cpu.start()
    cb = MemoryCallback(print_report=False)
    trainer = _hf_trainer(transformers, model, tmp_path, [cb, Bomb()])
    with pytest.raises(RuntimeError, match="can't allocate memory") as err:
        trainer.train()
    cb.close(err.value)  # transformers calls no callback when training raises: the user closes with the error
    r = err.value.memtorch_report
    assert isinstance(r, memtorch.OomReport) and r.requested == 2**52
    # the tied embedding and head share one storage: counted once
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert r.by_kind()["parameter"] == sum(storages.values())
    assert capsys.readouterr().err.count("memtorch: out of memory on cpu") == 1
    assert cb.tracker is None
    no_hooks(model)
