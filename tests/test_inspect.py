"""ModelMemory: figures, per-module rows, shared names, printing, HTML, to_numpy."""

import re

import numpy as np
import torch
from torch import nn

import memtorch
from memtorch.report import CATEGORIES, ModelMemory

import zoo

SEED_FC1 = (784 * 128 + 128) * 4  # 401,920
SEED_FC2 = (128 * 10 + 10) * 4  # 5,160


def test_figures_add_up_over_the_zoo():
    for name, build in zoo.ZOO.items():
        mm = memtorch.inspect(build())
        assert sum(mm.by_category.values()) == mm.total, name
        assert sum(mm.by_dtype.values()) == mm.total, name
        assert sum(mm.by_device.values()) == mm.total, name
        params = mm.by_category.get("parameter", 0)
        assert mm.trainable + mm.frozen == params, name
        root = mm.modules[0]
        assert root.name == "" and root.subtree == mm.total, name


def test_seed_model_per_module_rows():
    mm = memtorch.inspect(zoo.seed_model())
    rows = {m.name: m for m in mm.modules}
    assert list(rows) == ["", "fc1", "fc2"]
    assert rows["fc1"].own == rows["fc1"].subtree == rows["fc1"].parameters == SEED_FC1
    assert rows["fc2"].own == SEED_FC2
    assert rows[""].own == 0 and rows[""].subtree == SEED_FC1 + SEED_FC2
    assert rows["fc1"].type == "Linear" and rows[""].type == "SeedModel"


def test_per_module_rows_with_grads_and_state():
    model = zoo.seed_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 784)).sum().backward()
    opt.step()
    rows = {m.name: m for m in memtorch.inspect(model, opt).modules}
    # SGD with momentum: one momentum buffer per parameter, same size.
    fc1 = rows["fc1"]
    assert (fc1.parameters, fc1.gradients, fc1.optimizer_state) == (SEED_FC1, SEED_FC1, SEED_FC1)
    assert fc1.own == 3 * SEED_FC1
    assert rows[""].subtree == 3 * (SEED_FC1 + SEED_FC2)


def test_subtree_counts_a_tied_weight_once():
    mm = memtorch.inspect(zoo.tied_transformer())
    rows = {m.name: m for m in mm.modules}
    emb = 100 * 32 * 4
    # The rule: charged to the first holder in registration order (embed),
    # shown as shared under the second (head).
    assert rows["embed"].own == emb and rows["head"].own == 0 and rows["head"].shared == emb
    assert rows[""].subtree == mm.total
    # the columns add up: own over all modules is the total, subtree of each
    # child is the sum of own over its subtree.
    assert sum(m.own for m in mm.modules) == mm.total and mm.outside_modules == 0
    children = [m for m in mm.modules if m.name and "." not in m.name]
    assert sum(c.subtree for c in children) + rows[""].own == rows[""].subtree


def test_shared_groups():
    mm = memtorch.inspect(zoo.tied_transformer())
    assert mm.shared == [("embed.weight", "head.weight")]
    assert memtorch.inspect(zoo.seed_model()).shared == []


def test_str_is_a_table_with_units():
    model = zoo.seed_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 784)).sum().backward()
    opt.step()
    text = str(memtorch.inspect(model, opt))
    assert text.startswith("ModelMemory of SeedModel")
    lines = text.splitlines()
    assert any(re.match(r"\s*fc1\s+Linear\s", ln) for ln in lines)
    total_line = [ln for ln in lines if ln.startswith("total")][0]
    # 4 * 407,080 + 16 bytes = 1,628,336 B = 1.55 MiB
    assert "1.6 MiB" in total_line and "1,628,336 B" in total_line
    # the totals print the words tables use (words.label): "optimizer state", not the key
    assert re.search(r"^optimizer state +795.1 KiB$", text, re.M) and "optimizer_state" not in text and "gradient" in text
    # every figure carries its unit
    for ln in lines[3:]:
        for num in re.findall(r"\d+\.\d+(?!\d)(\s*\S+)?", ln):
            assert num.strip() in ("B", "KiB", "MiB", "GiB", "TiB"), ln


def test_str_shows_logical_when_it_differs_and_shared_names():
    text = str(memtorch.inspect(zoo.view_buffer()))
    assert re.search(r"^logical\s+160 B", text, re.M)
    assert "weight = row0" in text


def test_html():
    html = memtorch.inspect(zoo.seed_model())._repr_html_()
    assert html.startswith("<div") and "<table" in html and "397.5 KiB" in html and "fc1" in html


def test_to_numpy_rows():
    mm = memtorch.inspect(zoo.view_buffer())
    rows = mm.to_numpy()
    assert list(rows["path"]) == ["weight", "row0"]
    assert list(rows["category"]) == ["parameter", "buffer"]
    assert list(rows["dtype"]) == ["float32", "float32"]
    assert list(rows["device"]) == ["cpu", "cpu"]
    assert list(rows["numel"]) == [32, 8]
    assert list(rows["nbytes"]) == [128, 32]
    assert rows["storage"][0] == rows["storage"][1]
    assert list(rows["storage_nbytes"]) == [128, 128]
    assert list(rows["requires_grad"]) == [True, False]


def test_empty():
    mm = memtorch.inspect(nn.ReLU())
    assert mm.total == 0 and mm.by_dtype == {} and mm.shared == []
    assert "0 B" in str(mm)
    assert len(mm.to_numpy()) == 0


def test_large_table_is_truncated():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(200)])
    text = str(memtorch.inspect(model))
    assert "more module(s)" in text
    assert len(text.splitlines()) < 120


def test_categories_names_match_c():
    assert CATEGORIES[:4] == ("parameter", "buffer", "gradient", "optimizer_state")
    assert isinstance(memtorch.inspect(zoo.seed_model()), ModelMemory)


def test_numel():
    assert memtorch.inspect(zoo.seed_model()).numel == 784 * 128 + 128 + 128 * 10 + 10
    rows = memtorch.inspect(zoo.tied_transformer()).to_numpy()
    assert np.count_nonzero(rows["path"] == "head.weight") == 1


def test_quickstart_example_runs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "quickstart.py")], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # seed model: (784*128 + 128 + 128*10 + 10) * 4 = 407,080 B; after one Adam
    # step: params + grads + 2 x params of state + four 4-byte steps
    assert "(407,080 B, each storage once)" in out.stdout
    assert f"({4 * 407_080 + 16:,} B, each storage once)" in out.stdout
    assert "optimizer state  " in out.stdout and "optimizer_state" not in out.stdout


# ---------------------------------------------------------------- issue 10: numel, the per-module rule
def test_numel_counts_every_parameter_once():
    m = nn.Module()
    base = torch.zeros(30_000)
    for i in range(3):  # three parameters, each a view of one 30,000-element storage
        m.register_parameter(f"p{i}", nn.Parameter(base[i * 10_000 : (i + 1) * 10_000]))
    mm = memtorch.inspect(m)
    assert mm.numel == 30_000
    assert mm.total == 120_000  # the storage once
    t = zoo.tied_transformer()
    assert memtorch.inspect(t).numel == sum(p.numel() for p in t.parameters())  # tied weight once


def test_module_table_rule_two_names_and_columns_add_up():
    m = zoo.multi_name_submodule()
    mm = memtorch.inspect(m)
    firsts = [r for r in mm.modules if r.alias_of is None]
    aliases = [r for r in mm.modules if r.alias_of is not None]
    assert aliases and all(r.own == r.subtree == 0 for r in aliases)
    assert sum(r.own for r in mm.modules) + mm.outside_modules == mm.total
    for r in firsts:
        assert r.own == r.parameters + r.buffers + r.gradients + r.optimizer_state + r.attributes
    text = str(mm)
    assert "under the first module that holds it in registration order" in text


def test_tied_weight_optimizer_state_follows_the_charged_module():
    model = zoo.tied_transformer()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randint(0, 100, (2, 5))).sum().backward()
    opt.step()
    mm = memtorch.inspect(model, opt)
    rows = {r.name: r for r in mm.modules}
    emb = 100 * 32 * 4
    # embed holds the weight first: its grad and both Adam moments are charged there too
    assert (rows["embed"].parameters, rows["embed"].gradients, rows["embed"].optimizer_state) == (emb, emb, 2 * emb + 4)
    # head reaches the weight and its grad again (the state is filed once, under
    # the parameter's first holder): both shown as shared, none in own
    assert rows["head"].own == 0 and rows["head"].shared == 2 * emb
    assert sum(r.own for r in mm.modules) + mm.outside_modules == mm.total
