"""CUDA at_peak on a CPU machine: the caching allocator's history, replayed.

The traces are real (tests/data/h200/: two training steps on an NVIDIA H200, as
``torch.cuda.memory._snapshot()`` saved them). What track()'s hooks would have
kept (phase and module marks with their times, the names walks) is made here
from the trace itself, independently of the code under test: the phases from
each allocation's Python stack and the optimizer's own annotations, the names
by matching the sizes of the model's tensors (cases.py, built on the CPU) with
the allocator's requests. Expected figures are hand counts from the models
(block rounding as the allocator does it) and the true counters in cases.json.

The last part fakes ``torch.cuda`` (counters and the history) to run track()'s
CUDA path end to end and to check that the history's state is restored.
"""

import collections
import gzip
import importlib.util
import json
import pathlib
import pickle

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import memtorch  # noqa: E402
from memtorch import _cuda_trace as ct  # noqa: E402
from memtorch import cuda as mcuda  # noqa: E402
from memtorch import peak as mpeak  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data" / "h200"
KiB, MiB = 1024, 1024**2
FACTS = json.loads((DATA / "facts.json").read_text())
WS = ct.workspaces(tuple(FACTS["capability"]))


def _cases():
    spec = importlib.util.spec_from_file_location("h200_cases", DATA / "cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _truth(case):
    return next(c for c in json.loads((DATA / "cases.json").read_text())["cases"] if c["case"] == case)


def _snap(case):
    with gzip.open(DATA / f"{case}.snapshot.pickle.gz") as f:
        return pickle.load(f)


def r512(n):
    return max(512, -(-n // 512) * 512)


# --- what the hooks would have kept, made from the trace ------------------------


def _pre_trace_blocks(snap):
    """[(address, requested bytes)] of the blocks allocated before the history began (the
    segments at the end, less what the trace allocated)."""
    trace = snap["device_traces"][0]
    made = {e["addr"] for e in trace if e["action"] == "alloc"}
    out = []
    for s in snap["segments"]:
        a = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated" and a not in made:
                out.append((a, b["requested_size"]))
            a += b["size"]
    return out


def _live_at(trace, t_us, since_us=None):
    """{address: requested bytes} of the allocations of the trace live at t_us (made after since_us)."""
    live = {}
    for e in trace:
        if e["time_us"] > t_us:
            break
        if e["action"] == "alloc" and (since_us is None or e["time_us"] >= since_us):
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return live


def _match(blocks, tensors, kind, suffix=""):
    """{address: (name, kind, None, None, None)}: each tensor (name, nbytes) takes a block
    of its size (tensors of one size are interchangeable for the totals)."""
    by_size = collections.defaultdict(list)
    for a, n in sorted(blocks.items()):
        by_size[n].append(a)
    out = {}
    for name, n in tensors:
        if by_size[n]:
            out[by_size[n].pop(0)] = (name + suffix, kind, None, None, None)
    return out


def _annotations(snap, what):
    """[(start_us, end_us)] of the optimizer's record_function annotations named ``what``."""
    starts, out = {}, []
    for a in snap["external_annotations"]:
        if a["name"].startswith(what):
            if a["stage"] == "START":
                starts[a["name"]] = a["time_us"]
            else:
                out.append((starts.pop(a["name"]), a["time_us"]))
    return out


def _in_model(e):
    return any(f["filename"] == "module.py" for f in e.get("frames") or ())


def _synth(case, modules=None):
    """(snapshot, marks, names walks, rows) for a shipped case. modules() makes, for each
    forward, a function (allocation -> module row) that files its allocations by module."""
    snap = _snap(case)
    trace = snap["device_traces"][0]
    model, inputs, _, opt, *_ = _cases().build(case)
    params = [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]
    buffers = [(n, b.numel() * b.element_size()) for n, b in model.named_buffers()]
    rows = [(n, type(m).__name__) for n, m in model.named_modules()]
    steps = _annotations(snap, "Optimizer.step")
    t_first = trace[0]["time_us"]
    # names at the start: the blocks from before the history are the parameters, buffers, inputs
    pre = dict(_pre_trace_blocks(snap))
    start_names = _match(pre, params, "parameter")
    start_names.update(_match({a: n for a, n in pre.items() if a not in start_names}, buffers, "buffer"))
    start_names.update(_match({a: n for a, n in pre.items() if a not in start_names},
                              [("input", x.numel() * x.element_size()) for x in inputs], "input"))  # fmt: skip
    walks = [((t_first - 1) * 1000, start_names)]
    state = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
             "sgd-momentum": ("momentum_buffer",)}[opt]  # fmt: skip
    for k, (t_start, t_end) in enumerate(steps):
        # the gradients: made by the backward (no Python stack: the autograd engine's thread)
        back = {a: n for a, n in _live_at(trace, t_start).items()}
        made = {e["addr"] for e in trace if e["action"] == "alloc" and not e["frames"] and e["time_us"] < t_start}
        grads = _match({a: n for a, n in back.items() if a in made}, params, "gradient", ".grad")
        walks.append((t_start * 1000, grads))
        if k == 0:  # the optimizer's state, made by its first step
            new = _live_at(trace, t_end, since_us=t_start)
            tensors = [(f"{n}.{key}", nb) for n, nb in params for key in state]
            walks.append((t_end * 1000 + 999, _match(new, tensors, "optimizer state")))
    # phases: the forward from the first allocation under the model's forward to its last;
    # the backward from there to the optimizer's step; the optimizer's annotations
    marks = []
    bounds = [(trace[0]["time_us"], None)] + [(s, e) for s, e in steps]
    for j, (t_after, _) in enumerate(bounds):
        t_next = steps[j][0] if j < len(steps) else None
        fwd = [e for e in trace if e["action"] == "alloc" and _in_model(e)
               and e["time_us"] >= (t_after if j == 0 else bounds[j][1])
               and (t_next is None or e["time_us"] < t_next)]  # fmt: skip
        if not fwd or t_next is None:
            continue
        last = fwd[-1]["time_us"]
        after = next(e["time_us"] for e in trace if e["time_us"] > last)
        marks.append((fwd[0]["time_us"] * 1000 - 1, ct.PHASE, 1))
        if modules is not None:
            row_now = None
            row_of = modules()
            for e in fwd:
                row = row_of(e)
                if row != row_now:
                    if row_now is not None:
                        marks.append((e["time_us"] * 1000 - 2, ct.EXIT, row_now))
                    marks.append((e["time_us"] * 1000 - 1, ct.ENTER, row))
                    row_now = row
            marks.append((after * 1000 - 2, ct.EXIT, row_now))
        marks.append((after * 1000 - 1, ct.PHASE, 2))
    for t_start, t_end in steps:
        marks.append((t_start * 1000, ct.PHASE, 3))
        marks.append((t_end * 1000 + 999, ct.PHASE_END, 0))
    return snap, marks, walks, rows


def _mlp_rows():
    """The MLP's module rows (0: the Sequential; 1..5: its children) of one forward's
    allocations, from the innermost frame, in call order: Linear, ReLU, Linear, ReLU, Linear."""
    state = {"last": None, "row": 0}

    def row(e):
        kind = e["frames"][0]["name"]  # "forward" (linear.py) or "relu" (functional.py)
        if kind != state["last"]:
            state["row"] += 1
            state["last"] = kind
        return state["row"]

    return row


# --- the replay: block sizes -----------------------------------------------------


@pytest.mark.parametrize("case", ["mlp-fp32", "resnet18-fp32"])
def test_replay_reaches_the_true_peak(case):
    snap = _snap(case)
    truth = _truth(case)
    r = ct.replay(snap)
    pre = sum(b for _, b, _, _ in r.pre_live)
    # the blocks from before the history began are the parameters, buffers and inputs, moved
    # to the GPU after the true figures' zero: the true peak is theirs plus the replay's rise
    assert pre + sum(b for _, b, _, _ in r.live) == truth["true_peak"]
    assert r.estimated == 0 and not r.notes


def test_block_sizes_follow_the_allocator_not_the_request():
    # the MLP's last weight is 1000 x 4096 fp32 = 16,384,000 B: > 1 MiB, so a segment of its
    # own rounded to 2 MiB (16 MiB) whose 393,216 B rest (under 1 MiB) is not split off:
    # the allocator counts 16,777,216 B; rounding the request to 512 B would say 16,384,000
    snap = _snap("mlp-fp32")
    first = next(e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["size"] == 16_384_000)
    r = ct.replay(snap, t1_us=first["time_us"])
    assert first["addr"] in {a for a, *_ in r.live}
    assert dict((a, b) for a, b, *_ in r.live)[first["addr"]] == 16 * MiB


def test_round_size_is_the_allocators():
    assert ct.round_size(1) == 512 and ct.round_size(512) == 512 and ct.round_size(513) == 1024
    # roundup_power2_divisions=4 between 1 and 2 MiB: steps of 256 KiB
    assert ct.round_size(1 * MiB + 1, [4]) == 1 * MiB + 256 * KiB
    assert ct.round_size(2 * MiB, [4]) == 2 * MiB


def test_cublas_workspace_sizes():
    assert ct.cublas_workspace_bytes((9, 0), env="") == FACTS["after_first_fp32_matmul"] == 32 * MiB
    assert ct.cublas_workspace_bytes((8, 0), env="") == 4096 * KiB * 2 + 16 * KiB * 8
    assert ct.cublas_workspace_bytes((8, 0), env=":4096:8") == 32 * MiB
    assert ct.cublaslt_workspace_bytes(env="") == MiB and ct.cublaslt_workspace_bytes(env="2048") == 2 * MiB


# --- at_peak from the real traces -------------------------------------------------


def test_mlp_owners_at_the_peak_against_hand_counts():
    snap, marks, walks, rows = _synth("mlp-fp32", _mlp_rows)
    truth = _truth("mlp-fp32")
    start = sum(b for _, b, _, _ in ct.replay(snap).pre_live)
    at = ct.attribute_cuda(snap, 0, start, truth["true_peak"], True, marks, walks, rows, workspaces=WS)
    assert at.exact, at.notes
    assert at.peak == at.total == truth["true_peak"]
    # hand counts: Linear(1024, 4096), Linear(4096, 4096), Linear(4096, 1000), fp32; each
    # tensor its own block rounded to 512 B, but the 16,384,000 B weight takes a whole 16 MiB
    # segment (its 384 KiB rest is not split off: under 1 MiB)
    params = 16 * MiB + 16 * KiB + 64 * MiB + 16 * KiB + 16 * MiB + r512(1000 * 4)
    assert params == 100_700_160
    k = at.by_kind()
    assert k["parameter"] == params
    assert k["input"] == 512 * 1024 * 4
    # the peak is in the first step's foreach Adam: gradients, exp_avg and exp_avg_sq, and one
    # temporary per parameter (torch._foreach_sqrt of exp_avg_sq), each as large as the parameters
    assert k["gradient"] == params
    assert k["optimizer state"] == 2 * params
    assert k["temporary"] == params and at["optimizer temporaries, not its state"] == params
    # cuBLAS: a 32 MiB workspace per handle (the forward's thread and the autograd engine's),
    # and cuBLASLt's 1 MiB (F.linear with a bias)
    assert at[mpeak.WORKSPACE] == 2 * 32 * MiB
    assert at[mpeak.WORKSPACE_LT] == MiB
    assert "activation" not in k  # the activations were freed by the backward
    names = {o.name for o in at.owners}
    assert {"0.weight", "4.weight.grad", "2.weight.exp_avg", "2.weight.exp_avg_sq"} <= names
    assert at.storages[0].nbytes == 64 * MiB


def test_mlp_activations_by_module_at_the_forwards_peak():
    # the window of the first forward alone: its highest point is after the second ReLU
    snap, marks, walks, rows = _synth("mlp-fp32", _mlp_rows)
    trace = snap["device_traces"][0]
    start = sum(b for _, b, _, _ in ct.replay(snap).pre_live)
    t1 = next(e["time_us"] for e in trace if e["frames"] and e["frames"][0]["filename"] == "cases.py")
    at = ct.attribute_cuda(snap, 0, start, start, False, marks, walks, rows, t1_ns=t1 * 1000 - 1000,
                              workspaces=WS)  # fmt: skip
    out = 512 * 4096 * 4  # a (512, 4096) fp32 activation: 8 MiB
    assert at["activations of 1 (ReLU)"] == out  # saved by ReLU for its backward
    assert at["activations of 2 (Linear)"] == out  # the next ReLU's input
    assert at["activations of 3 (ReLU)"] == out
    assert "activations of 0 (Linear)" not in at  # its output was freed by the first ReLU
    assert at[mpeak.WORKSPACE] == 32 * MiB and at[mpeak.WORKSPACE_LT] == MiB
    # the counters gave only a lower bound (start): the history's own figure replaces it
    assert at.peak == at.total == start + 3 * out + 33 * MiB
    assert any("allocator's history gives it" in n for n in at.notes)


def test_resnet18_owners_at_the_peak_against_hand_counts():
    snap, marks, walks, rows = _synth("resnet18-fp32")
    truth = _truth("resnet18-fp32")
    model, inputs, *_ = _cases().build("resnet18-fp32")
    start = sum(b for _, b, _, _ in ct.replay(snap).pre_live)
    at = ct.attribute_cuda(snap, 0, start, truth["true_peak"], True, marks, walks, rows, workspaces=WS)
    assert at.exact, at.notes
    assert at.peak == at.total == truth["true_peak"]
    k = at.by_kind()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    # every parameter its own 512 B-rounded block, but fc.weight (1000 x 512 fp32 = 2,048,000 B)
    # sits in a 2 MiB block the allocator did not split (the 48 KiB rest is under 1 MiB)
    assert k["parameter"] == sum(r512(n) for n in sizes) - r512(2_048_000) + 2 * MiB
    assert k["buffer"] == sum(r512(b.numel() * b.element_size()) for b in model.buffers())
    assert k["input"] == 32 * 3 * 224 * 224 * 4
    # the peak is in the second step's backward: SGD's momentum buffers (one per parameter, made
    # by the first step) are all there; a block over 1 MiB may hold up to 1 MiB more than asked
    big = sum(1 for n in sizes if n > MiB)
    assert sum(r512(n) for n in sizes) <= k["optimizer state"] <= sum(r512(n) for n in sizes) + big * MiB
    assert 0 < k["gradient"] <= k["parameter"]
    # what the forward saved for the backward, and the backward's own temporaries
    assert k["activation"] > 0 and k["temporary"] > 0
    assert at[mpeak.WORKSPACE] == 2 * 32 * MiB  # the fc layer's matmul, forward and backward
    assert at["backward temporaries, not gradients"] == k["temporary"]


def test_user_history_window_leaves_out_events_before_the_block():
    # a user's own history holds events from before the block: only the block's window counts
    snap, marks, walks, rows = _synth("mlp-fp32", _mlp_rows)
    trace = snap["device_traces"][0]
    steps = _annotations(snap, "Optimizer.step")
    t0 = steps[0][1] + 1  # the block opens after the first optimizer step
    r = ct.replay(snap, t0_us=t0)
    assert r.peak_at > 0 and trace[r.peak_at]["time_us"] >= t0
    # the live set at the block's start, as a replay up to it sizes it: the block's start
    upto = ct.replay(snap, t1_us=t0 - 1)
    start = sum(b for _, b, _, _ in upto.live + upto.pre_live) - upto.peak_delta + upto.end_delta
    assert set(_live_at(trace, t0)) <= {a for a, *_ in upto.live + upto.pre_live}
    at = ct.attribute_cuda(snap, 0, start, start + r.peak_delta, True, marks, walks, rows, t0_ns=t0 * 1000,
                              workspaces=WS, own=False)  # fmt: skip
    assert at.exact, at.notes
    assert at.total == at.peak == start + r.peak_delta
    # the workspaces were made before the block: not the block's own (no name from it)
    assert mpeak.WORKSPACE not in at and mpeak.WORKSPACE_LT not in at
    assert at.by_kind()["optimizer state"] == 2 * 100_700_160  # named by the walk after the first step


# --- track() on a faked CUDA device with a faked allocator history ----------------


class FakeHistory:
    """torch's caching allocator for track(): counters and its history (alloc/free entries
    with addresses and wall-clock times), recording on or off as torch would be."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.on = False
        self.trace = []
        self.calls = []
        self.next = 1 << 40

    def alloc(self, n):
        import time

        a, self.next = self.next, self.next + (1 << 30)
        b = r512(n)
        self.allocated += b
        self.peak = max(self.peak, self.allocated)
        if self.on:
            now = time.time_ns() // 1000
            self.trace.append({"action": "segment_alloc", "addr": a, "size": b, "time_us": now})
            self.trace.append({"action": "alloc", "addr": a, "size": n, "time_us": now})
        return a, b

    def free(self, ab):
        import time

        self.allocated -= ab[1]
        if self.on:
            now = time.time_ns() // 1000
            for act in ("free_requested", "free_completed"):
                self.trace.append({"action": act, "addr": ab[0], "size": ab[1], "time_us": now})

    def record(self, enabled, *a, **kw):
        self.calls.append(enabled)
        self.on = enabled is not None
        if not self.on:
            self.trace = []  # torch clears the history when recording stops

    def snapshot(self, *a):
        return {"segments": [], "device_traces": [list(self.trace)], "allocator_settings": {}}


@pytest.fixture
def fake_history(monkeypatch):
    h = FakeHistory()
    monkeypatch.setattr(mcuda, "_available", lambda: True)
    monkeypatch.setattr(mcuda, "_device_count", lambda: 1)
    monkeypatch.setattr(mcuda, "_current_device", lambda: 0)
    monkeypatch.setattr(mcuda, "_counters", lambda i: (h.allocated, h.peak, h.allocated, h.allocated))
    monkeypatch.setattr(torch._C, "_cuda_record_memory_history", lambda *a: None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: h.on, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", h.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", h.snapshot)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    return h


class Keeps(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.h, self.n, self.kept = h, n, []

    def forward(self, x):
        self.kept.append(self.h.alloc(self.n))  # what the forward saves, on the fake device
        return x


def test_track_on_cuda_names_activations_and_restores_the_history(fake_history):
    h = fake_history
    model = nn.Sequential(Keeps(h, 3 * MiB), Keeps(h, 5 * MiB))
    with memtorch.track(model, device="cuda") as t:
        model(torch.ones(2))
        tmp = h.alloc(7 * MiB)  # after the forward: the backward phase's
    r = t.report
    at = r.at_peak
    assert at is not None and at.exact, at and at.notes
    assert at.peak == at.total == r.peak == 15 * MiB
    assert at["activations of 0 (Keeps)"] == 3 * MiB and at["activations of 1 (Keeps)"] == 5 * MiB
    assert at["backward temporaries, not gradients"] == 7 * MiB
    # the history was off before the block: on for the block, then off (and cleared) again
    assert h.calls == ["all", None] and not h.on and h.trace == []
    h.free(tmp)


def test_track_on_cuda_reuses_the_users_history_and_leaves_it_on(fake_history):
    h = fake_history
    h.record("all")
    h.calls.clear()
    model = nn.Sequential(Keeps(h, MiB + 512))
    with memtorch.track(model, device="cuda") as t:
        model(torch.ones(2))
    assert t.report.at_peak["activations of 0 (Keeps)"] == MiB + 512
    assert h.calls == [] and h.on and len(h.trace) == 2  # the user's history untouched
