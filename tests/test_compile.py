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
