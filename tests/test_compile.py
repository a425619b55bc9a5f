"""track() beside torch.compile: memtorch's hooks never change the compiled program (issue 23 rows 1, 2)."""

import warnings

import pytest
import torch

import memtorch


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_compiled_inside_a_block_has_no_graph_break_and_no_warning():
    """torch.compile's first call inside track(model): dynamo's own counters show one graph
    and no break (before: a break on each C hook, no graph), and torch's warning about
    global module hooks is not raised (memtorch registers none), even as an error."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = _mlp()
    cm = torch.compile(m, backend="eager")  # dynamo only: no C++ compile, fast
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with memtorch.track(m):
            cm(x).sum().backward()
        with memtorch.track(cm):  # the compiled module itself
            cm(x).sum().backward()
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] >= 1
    # nothing of memtorch left on the modules
    for mod in cm.modules():
        assert not mod._forward_pre_hooks and not mod._forward_hooks
    torch._dynamo.reset()


def _forward_bytes(cm, x):
    """Bytes the forward allocated, by torch.profiler's memory events (an independent measurement)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = cm(x)
    del y
    return sum(max(e.cpu_memory_usage, 0) for e in prof.events())


@pytest.mark.slow
def test_compiled_inside_a_block_keeps_the_compiled_forward_after_it():
    """Inductor (C++): the forward's allocation after a block in which the model was first
    compiled equals that of the same model compiled without memtorch, both read by
    torch.profiler. compile_threads=1: no compile worker pool, whose thread would outlive
    the test (the kernels are the same)."""
    x = torch.randn(64, 8)
    with torch._inductor.config.patch(compile_threads=1):
        torch._dynamo.reset()
        plain = torch.compile(_mlp())
        with torch.no_grad():
            plain(x)
        want = _forward_bytes(plain, x)
        torch._dynamo.reset()
        m = _mlp()
        cm = torch.compile(m)
        with memtorch.track(m), torch.no_grad():
            cm(x)
        got = _forward_bytes(cm, x)
        torch._dynamo.reset()
    assert got == want


@pytest.mark.slow
def test_a_chain_of_20000_modules_needs_no_deep_recursion():
    """inspect(), its text and HTML tables and track()'s walk of the modules (odd-input corpus)."""
    root = torch.nn.Linear(2, 2)  # 6 float32: 24 B
    for _ in range(20_000):
        w = torch.nn.Module()
        w.add_module("c", root)
        root = w
    mm = memtorch.inspect(root)
    assert mm.total == 24
    assert "20001 modules" in str(mm) and mm._repr_html_()
    with memtorch.track(root) as t:
        pass
    assert t.report.end == t.report.start


def test_sizeof_of_a_dataclass_whose_field_table_is_stripped_while_walked():
    """A property that deletes the Fields' attributes while the walk runs: the right count
    (each field read by its name in the table), never an AttributeError from memtorch."""
    import dataclasses

    @dataclasses.dataclass
    class D:
        a: object = None
        b: object = None

    def strip(self):
        for f in list(type(self).__dataclass_fields__.values()):
            for attr in ("name", "_field_type"):
                try:
                    delattr(f, attr)
                except AttributeError:
                    pass
        return torch.zeros(10)  # 40 B

    D.a = property(strip, lambda s, v: None)
    d = D(b=torch.zeros(5))  # 20 B
    assert memtorch.sizeof([d, D(b=torch.zeros(5))]).total == 2 * (40 + 20)
    assert memtorch.sizeof(d).total == 60  # the table stripped before this walk


# --- row 3: the modules inside a compiled region say that they cannot be split ---------------


def _eager_backend_block(target, call, x):
    """A training step of ``call`` inside track(target), compiled with dynamo's eager backend
    (the graph runs the same aten ops as eager mode, so the bytes are eager's: hand-countable)."""
    call(x).sum().backward()  # compiled before the block
    with memtorch.track(target) as t:
        call(x).sum().backward()
    return t.report


def _by_name(report):
    return {m.name: m for m in report.modules}


def test_a_compiled_wrapper_holds_its_regions_bytes_and_its_insides_say_they_cannot_be_split():
    """track(torch.compile(m)): the wrapper's own hooks run outside the graph, so its row has the
    forward; the 4 modules inside (_orig_mod and its 3 children) have no figures of their own and
    say why, in the rows, the text and to_dict. Hand count of what the forward leaves alive
    (x 2x8 fp32): ReLU's output 2x16x4 = 128 B (saved by the second Linear and by ReLU) and the
    output 2x4x4 = 32 B; the first Linear's output dies once ReLU ran: 160 B."""
    torch._dynamo.reset()
    m = _mlp()
    cm = torch.compile(m, backend="eager")
    r = _eager_backend_block(cm, cm, torch.randn(2, 8))
    rows = _by_name(r)
    assert rows[""].calls == 1 and rows[""].activation_bytes == 160
    assert "4 module(s) inside run as a compiled graph and cannot be split" in rows[""].note
    for name in ("_orig_mod", "_orig_mod.0", "_orig_mod.1", "_orig_mod.2"):
        assert rows[name].calls == 0 and rows[name].note == "inside the compiled region (model): cannot be split"
    said = [c for c in r.caveats if "is compiled (torch.compile)" in c]
    assert len(said) == 1 and "their bytes are in (model)'s row" in said[0]
    for text in (str(r), r.to_text()):
        assert said[0] in text
    assert r.to_dict()["modules"][1]["note"] == "inside the compiled region (model): cannot be split"
    torch._dynamo.reset()


def test_a_submodule_compiled_in_place_is_one_region_inside_its_parents_row():
    """m[2].compile(): the submodule's own hooks are inside its graph (0 calls), its bytes are in
    the root's row, which still runs eagerly: 160 B as without compiling (hand count above)."""
    torch._dynamo.reset()
    m = _mlp()
    m[2].compile(backend="eager")
    r = _eager_backend_block(m, m, torch.randn(2, 8))
    rows = _by_name(r)
    assert rows[""].calls == 1 and rows[""].activation_bytes == 160 and rows[""].note is None
    assert rows["0"].calls == 1 and rows["0"].note is None
    assert rows["2"].calls == 0
    assert rows["2"].note.startswith("compiled by 2.compile(): it and its 0 module(s) inside run as a compiled graph")
    assert rows["2"].note.endswith("their bytes are in (model)'s row")
    assert any(c.startswith("2 is compiled (2.compile())") for c in r.caveats)
    torch._dynamo.reset()


def test_a_module_compiled_inside_a_block_or_before_it_is_said_by_every_block():
    """m[2].compile() before a block, and m2[2].compile() inside one, whose compiled code dynamo may take
    from its cache (the same module class compiled before: no frame compiled, no counter of dynamo moves):
    each block's end reads the modules themselves, so each says the region is compiled."""
    memtorch.cpu.start()  # counting held: the blocks take the per-step path (Tracker._enter_lean)
    torch._dynamo.reset()
    m, x = _mlp(), torch.randn(2, 8)
    with memtorch.track(m) as t:
        m(x).sum().backward()
    assert not any("compiled" in c for c in t.report.caveats)
    m[2].compile(backend="eager")
    for _ in range(2):  # the first may be the block that compiles it
        with memtorch.track(m) as t:
            m(x).sum().backward()
        r = t.report
        assert _by_name(r)["2"].calls == 0
        assert any(c.startswith("2 is compiled (2.compile())") for c in r.caveats)
    m2 = _mlp()
    with memtorch.track(m2) as t:
        m2[2].compile(backend="eager")
        m2(x).sum().backward()
    r = t.report
    assert _by_name(r)["2"].calls == 0 and any(c.startswith("2 is compiled (2.compile())") for c in r.caveats)
    torch._dynamo.reset()


def test_a_root_compiled_in_place_says_that_it_has_no_phases():
    torch._dynamo.reset()
    m = _mlp()
    m.compile(backend="eager")
    r = _eager_backend_block(m, m, torch.randn(2, 8))
    assert r.phases == {}  # the root's own hooks were compiled away with the rest
    assert r.peak_above_start > 0
    (said,) = [c for c in r.caveats if "model.compile()" in c]
    assert "with no phases: the model's own hooks are in the graph too" in said
    torch._dynamo.reset()


def test_tracking_a_model_run_through_its_compiled_wrapper_says_to_track_the_wrapper():
    torch._dynamo.reset()
    m = _mlp()
    cm = torch.compile(m, backend="eager")
    r = _eager_backend_block(m, cm, torch.randn(2, 8))
    assert r.phases == {} and all(row.calls == 0 for row in r.modules)
    assert any("track the wrapper (memtorch.track(compiled, ...))" in c for c in r.caveats)
    # eager, no compiled graph in the block's model: no such note
    torch._dynamo.reset()
    m2 = _mlp()
    with memtorch.track(m2) as t:
        m2(torch.randn(2, 8)).sum().backward()
    assert not any("compiled" in c for c in t.report.caveats)
