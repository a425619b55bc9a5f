"""memtorch.diagram(): Mermaid class and ER diagrams.

Figures expected here are derived by hand (numel x 4 bytes for float32) or
from torch's own untyped_storage().nbytes(). The render tests run Mermaid's
own JavaScript (shipped for offline use by the `mermaidx` package, a test
dependency) in headless Chromium (Debian's `chromium`), fail on any parse
error, check the drawn text and save a PNG of each diagram.
"""

import os
import pathlib
import re
import struct

import pytest
import torch
from torch import nn

import memtorch
from memtorch import mermaid

import mermaid_render


class SimpleModel(nn.Module):
    """The seed document's model."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 128)
        self.fc2 = nn.Linear(128, 10)


class Tied(nn.Module):
    """A weight tied between an embedding and an output layer, and one submodule under two names."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.again = self.enc


class Flat(nn.Module):
    """Two parameters that view one 100-element storage (as a flat-parameter wrapper does)."""

    def __init__(self):
        super().__init__()
        buf = torch.zeros(100)
        self.a = nn.Parameter(buf[:10])
        self.b = nn.Parameter(buf[10:30])


def transformer(layers=12):
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


ODD_NAMES = ['a "quoted" name', "<script>alert(1)</script>", "x;y %% z", "{}#~`*$", "层", "(p) [q]", "end"]


def odd_model():
    """Module names, a parameter name and type names that mean something in Mermaid or HTML."""
    Odd = type('Odd<T> "x" (y)', (nn.Module,), {})
    End = type("end", (nn.Module,), {})
    root = Odd()
    for i, name in enumerate(ODD_NAMES):
        child = End() if name == "end" else nn.Linear(2, i + 1)
        if name == "end":
            child.p = nn.Parameter(torch.zeros(1))
        root._modules[name] = child  # add_module refuses some of these names; torch itself does not
    root._parameters['w (1) "ok"'] = nn.Parameter(torch.zeros(3))
    return root


def storage_bytes(*tensors):
    """Bytes of the distinct storages, from torch itself."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def decode(text):
    return re.sub(r"#(\d+);", lambda m: chr(int(m.group(1))), text)


# ---------------------------------------------------------------- the text


def test_class_diagram_of_the_seed_model():
    text = memtorch.diagram(SimpleModel())
    lines = [line.strip() for line in text.splitlines()]
    assert lines[0] == "classDiagram"
    # fc1 and fc2 are Linear modules of different shapes: two classes, told apart by path.
    assert 'class SimpleModel["SimpleModel"] {' in lines
    assert 'class Linear["Linear (fc1)"] {' in lines
    assert 'class Linear_2["Linear (fc2)"] {' in lines
    # Bytes by hand: 128*784*4, 128*4, 10*128*4, 10*4.
    body = decode(text)
    assert "+weight float32[128, 784] 392.0 KiB (401,408 B)" in body
    assert "+bias float32[128] 512 B" in body
    assert "+weight float32[10, 128] 5.0 KiB (5,120 B)" in body
    assert "+bias float32[10] 40 B" in body
    assert (
        f"model total 397.5 KiB ({401408 + 512 + 5120 + 40:,} B), {128 * 784 + 128 + 1280 + 10:,} parameter"
        in body
    )
    assert "SimpleModel *-- Linear : fc1" in lines
    assert "SimpleModel *-- Linear_2 : fc2" in lines


def test_figures_come_from_inspect():
    model = transformer(3)
    mm = memtorch.inspect(model)
    body = decode(memtorch.diagram(model))
    assert f"model total {memtorch.units.format(mm.total)} ({mm.total:,} B)" in body
    assert mm.total == storage_bytes(*model.parameters())


def test_repeated_blocks_collapse_to_one_class_and_one_arrow():
    model = transformer(12)
    text = memtorch.diagram(model)
    assert text.count('class TransformerEncoderLayer["TransformerEncoderLayer"]') == 1
    # Modules that hold nothing and have no children are listed in their parent, not drawn.
    assert "class Dropout" not in text
    assert "        +dropout, dropout1, dropout2: Dropout x 3, no tensors" in text.splitlines()
    assert '    ModuleList *-- "12" TransformerEncoderLayer : 0-11 x 12' in text.splitlines()
    # All 12 layers together: the bytes of their storages, each once, as torch counts them.
    together = storage_bytes(*model.layers.parameters())
    assert f"x 12 instances: {memtorch.units.format(together)} ({together:,} B) together" in decode(text)


def test_er_collapses_runs_and_counts_the_run_once():
    model = transformer(12)
    text = decode(memtorch.diagram(model, kind="er"))
    assert text.startswith("erDiagram\n")
    assert 'MODULE layers.0-11: TransformerEncoderLayer x 12"]' in text
    one = storage_bytes(*model.layers[0].parameters())
    assert f'int subtree "{memtorch.units.format(one)} ({one:,} B) each"' in text
    together = storage_bytes(*model.layers.parameters())
    assert f'int all "{memtorch.units.format(together)} ({together:,} B) for the 12 together"' in text
    # Inside the run, each parameter is drawn once with its count.
    assert "PARAMETER layers.0-11.linear1.weight x 12" in text
    assert text.count("linear1.weight") == 1


def test_er_tied_parameter_is_one_entity_held_by_two_modules():
    model = Tied()
    text = decode(memtorch.diagram(model, kind="er"))
    entities = re.findall(r'^    (PARAMETER_\d+)\["PARAMETER (emb|head)\.weight"\]', text, re.M)
    assert len(entities) == 1, entities  # one entity for the tied storage
    pid = entities[0][0]
    holders = re.findall(rf"^    (\S+) \}}\|--o\{{ {pid} : \"weight\"$", text, re.M)
    assert len(holders) == 2
    labels = dict(re.findall(r'^    (MODULE_\d+)\["MODULE (\w+): ', text, re.M))
    assert sorted(labels[h] for h in holders) == ["emb", "head"]
    assert 'string shared_with "head.weight, counted once"' in text
    # Counted once in the model's total: 10*4*4 (tied) + 4*4*4 + 4*4 (linear)
    # + 4*4*2 + 4*4*2 + 8 (batch norm).
    assert 'int total "312 B, each storage once"' in text
    assert 312 == 160 + 64 + 16 + 32 + 32 + 8
    # The submodule registered twice is drawn once, with a relation for its second name.
    assert text.count(": Sequential") == 1
    assert re.search(r'^    MODEL \}\|--\|\| MODULE_\d+ : "again \(same module as enc\)"$', text, re.M)


def test_class_diagram_tied_and_alias():
    text = decode(memtorch.diagram(Tied()))
    assert "+weight float32[10, 4] 160 B shared with head.weight, counted once" in text
    assert "+weight float32[10, 4] 160 B shared with emb.weight, counted once" in text
    assert "Tied o-- Sequential : again = enc (same module)" in text


def test_depth_limit_hides_levels_and_says_so():
    model = transformer(12)
    n_below = len(list(model.modules())) - 1  # every module but the model itself
    text = decode(memtorch.diagram(model, depth=0))
    assert "TransformerEncoderLayer" not in text
    assert f"{n_below} submodules below depth 0 not drawn" in text
    text = decode(memtorch.diagram(model, depth=1))
    assert "class ModuleList" in text and "TransformerEncoderLayer" not in text
    assert f"{n_below - 1} submodules below depth 1 not drawn" in text
    er = decode(memtorch.diagram(model, kind="er", depth=2))
    assert "TransformerEncoderLayer x 12" in er and "linear1" not in er
    per_layer = len(list(model.layers[0].modules())) - 1
    assert f'int not_drawn "{per_layer} submodules below depth 2"' in er


def test_memory_false_leaves_bytes_out():
    for kind in ("class", "er"):
        text = decode(memtorch.diagram(SimpleModel(), kind=kind, memory=False))
        assert not re.search(r"\d B\b", text), text
        assert "float32[128, 784]" in text or 'shape "[128, 784]"' in text


def test_odd_names_are_escaped():
    for kind in ("class", "er"):
        text = memtorch.diagram(odd_model(), kind=kind)
        for line in text.splitlines()[1:]:
            # Inside labels and comments no quote, brace, angle bracket, semicolon or
            # percent sign is left raw: each is an entity code.
            for quoted in re.findall(r'"([^"]*)"', line):
                assert re.fullmatch(r"(?:[^{}<>;%`#]|#\d+;)*", quoted), quoted
        decoded = decode(text)
        for name in ODD_NAMES:
            assert name in decoded, (kind, name)
        assert 'Odd<T> "x" (y)' in decoded
    # A class named after a Mermaid keyword gets a safe id.
    assert "class M_end[" in memtorch.diagram(odd_model())


def test_escape_round_trip():
    s = 'a"b<c>{d}(e)[f];g%h#i`j~k$l*m\n层'
    for member in (False, True):
        out = mermaid._esc(s, member=member)
        assert decode(out) == s
        assert set(out) <= mermaid._SAFE | set("#;0123456789") | (set() if member else set("()"))
    assert "(" not in mermaid._esc("(e)", member=True)  # in a class member a parenthesis makes a method


def test_names_label():
    assert mermaid._names_label([str(i) for i in range(12)]) == "0-11"
    assert mermaid._names_label(["0", "2"]) == "0, 2"
    assert mermaid._names_label(["a", "b", "c", "d", "e", "f"]) == "a, b, c, d, ... 2 more"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"model": {"w": 1}}, TypeError, "diagram() takes a torch.nn.Module, not dict"),
        ({"kind": "flowchart"}, ValueError, "kind must be one of 'class', 'er', not 'flowchart'"),
        ({"depth": -1}, ValueError, "depth must be None (every level) or an int >= 0"),
        ({"depth": True}, ValueError, "depth must be None (every level) or an int >= 0"),
        ({"depth": 1.5}, ValueError, "depth must be None (every level) or an int >= 0"),
        ({"memory": "yes"}, TypeError, "memory must be True or False, not 'yes'"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    args = {"model": SimpleModel(), **kwargs}
    with pytest.raises(error) as info:
        memtorch.diagram(**args)
    assert message in str(info.value)


def test_meta_model_and_empty_model():
    with torch.device("meta"):
        model = SimpleModel()
    text = decode(memtorch.diagram(model))
    assert "+weight float32[128, 784] 392.0 KiB (401,408 B)" in text
    empty = decode(memtorch.diagram(nn.Module(), kind="er"))
    assert 'MODEL["MODEL Module"]' in empty and 'int total "0 B' in empty


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def renderer():
    chromium = mermaid_render.find_chromium()
    if chromium is None:
        pytest.skip(
            "no chromium on PATH (Debian: apt-get install -y chromium): Mermaid rendering not checked"
        )
    r = mermaid_render.Renderer(chromium, mermaid_render.mermaid_js())
    yield r
    r.close()


@pytest.fixture(scope="module")
def png_dir(tmp_path_factory):
    """Where the PNGs go: $MEMTORCH_DIAGRAM_PNG_DIR, else pytest's temporary directory (kept for 3 runs)."""
    where = os.environ.get("MEMTORCH_DIAGRAM_PNG_DIR")
    if where:
        path = pathlib.Path(where)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("diagrams")


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


CASES = {
    "seed": (SimpleModel, {}),
    "tied": (Tied, {}),
    "transformer12": (transformer, {}),
    "transformer12-depth2": (transformer, {"depth": 2}),
    "odd-names": (odd_model, {}),
    "views": (Flat, {}),
    "no-memory": (SimpleModel, {"memory": False}),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["class", "er"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mermaid_renders_it(case, kind, renderer, png_dir):
    make, kwargs = CASES[case]
    text = memtorch.diagram(make(), kind=kind, **kwargs)
    png = png_dir / f"{case}-{kind}.png"
    out = renderer.render(text, png)
    assert out["ok"], f"Mermaid could not draw the {kind} diagram of {case}: {out['error']}\n{text}"
    assert _png_size(png) == (out["width"], out["height"])
    assert out["width"] > 100 and out["height"] > 100
    drawn = out["text"]
    if case == "odd-names":
        # The odd names are drawn as they are: nothing swallowed as markup or syntax.
        for name in ODD_NAMES + ['Odd<T> "x" (y)']:
            assert name in drawn, name
    if case == "transformer12" and kind == "class":
        assert "TransformerEncoderLayer" in drawn and "0-11 x 12" in drawn


@pytest.mark.slow
def test_render_harness_catches_a_parse_error(renderer):
    out = renderer.render("classDiagram\n    class A {\n    A *-- \n")
    assert not out["ok"] and "Parse error" in out["error"], out


def test_deep_nest_stays_linear_in_size():
    model = nn.Linear(2, 2)
    for _ in range(300):
        model = nn.Sequential(model)
    for kind in ("class", "er"):
        text = memtorch.diagram(model, kind=kind)
        assert len(text) < 300 * 400, len(text)  # long paths are cut from the left, not repeated in full
        assert "..." in text
        shallow = decode(memtorch.diagram(model, kind=kind, depth=10))
        assert len(shallow) < 3000
        # 300 Sequential + 1 Linear = 301 modules; depths 0 to 10 drawn (11): 290 below.
        assert "290 submodules below depth 10" in shallow


def test_one_module_under_many_names_is_one_line():
    layer = nn.Linear(4, 4)
    model = nn.Sequential(nn.ModuleList([layer] * 12))
    assert "    ModuleList o-- Linear : 1-11 = 0.0 (same module)" in memtorch.diagram(model).splitlines()
    er = memtorch.diagram(model, kind="er")
    assert er.count("same module as") == 1 and '"1-11 (same module as 0.0)"' in er
    assert 'int total "80 B, each storage once"' in er  # (4*4 + 4) * 4 bytes, once


def test_views_of_one_storage_are_entities_of_their_own():
    model = Flat()
    text = decode(memtorch.diagram(model))
    # The storage is 100 * 4 = 400 B; the tensors 10 * 4 and 20 * 4 bytes.
    assert "+a float32[10] 400 B storage, the tensor itself 40 B shared with b, counted once" in text
    assert "+b float32[20] 400 B storage, the tensor itself 80 B shared with a, counted once" in text
    er = decode(memtorch.diagram(model, kind="er"))
    assert 'PARAMETER a"]' in er and 'PARAMETER b"]' in er
    assert 'int total "400 B, each storage once"' in er
    assert storage_bytes(model.a, model.b) == 400
    # Each entity has one holder: "exactly one" on the module side.
    assert re.findall(r"^    MODEL (\S+) PARAMETER_\d : ", er, re.M) == ["||--o{", "||--o{"]


# ---------------------------------------------------------------- the HTML page


def _html_page(tmp_path, monkeypatch, capsys):
    from memtorch import cli

    (tmp_path / "diagmods.py").write_text(
        "from torch import nn\n\ndef mlp():\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["diagram", "diagmods:mlp", "--format", "html", "--quiet"]) == 0
    captured = capsys.readouterr()
    page = tmp_path / "diagram.html"
    page.write_text(captured.out, encoding="utf-8")
    return page, captured.err


def test_html_page_draws_in_a_browser_offline(tmp_path, monkeypatch, capsys):
    page, err = _html_page(tmp_path, monkeypatch, capsys)
    text = page.read_text(encoding="utf-8")
    assert '<pre class="mermaid">' in text and "https://" not in text.split("<script>", 1)[0]
    assert "mermaid.run()" in text and "<script src=" not in text and err == ""  # Mermaid's script inlined
    chromium = mermaid_render.find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium): the page's drawing not checked")
    import subprocess

    # no network: --dump-dom prints the DOM after the scripts ran (the page's script is its own); the
    # sanitizer pass's preloads stay out of the browser, as mermaid_render's Renderer keeps them out
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONMALLOC")}
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=30000",
         "--proxy-server=127.0.0.1:9", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180, env=env,
    ).stdout  # fmt: skip
    svg = re.search(r'<svg id="mermaid-[^"]*"[^>]*class="classDiagram"', dom)
    assert svg, dom[:2000]
    assert "Sequential" in dom[svg.start():] and "Linear" in dom[svg.start():]


def test_html_page_without_mermaidx_loads_the_script_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mermaid, "_mermaid_script", lambda: (None, mermaid.MERMAID_CDN))
    page, err = _html_page(tmp_path, monkeypatch, capsys)
    assert f'<script src="{mermaid.MERMAID_CDN}"></script>' in page.read_text(encoding="utf-8")
    assert "needs the network" in err
