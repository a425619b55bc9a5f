"""examples/quickstart.ipynb runs top to bottom (nbclient) and shows tables and plots."""

import base64
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"

# Net(d=128, depth=4) of the notebook, by hand: Linear(i, o) holds i*o + o elements, LayerNorm(d) 2*d
PARAMS = (784 * 128 + 128) + 4 * (2 * 128 + (128 * 512 + 512) + (512 * 128 + 128)) + (128 * 10 + 10)


def _outputs(nb):
    html, png = [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", out
            # nothing on stderr: no warning from an import memtorch causes (tqdm's "IProgress not found",
            # reached through bitsandbytes' import in advise's rows)
            assert out.get("name") != "stderr", out
            data = out.get("data", {})
            if "text/html" in data:
                html.append(data["text/html"])
            if "image/png" in data:
                png.append(base64.b64decode(data["image/png"]))
    return html, png


def _check(nb):
    html, png = _outputs(nb)
    assert any("<table" in h and "memtorch-modules" in h for h in html)  # the module tree
    assert any(f"{PARAMS:,} parameters" in h for h in html)
    assert any("memtorch.track on cpu" in h for h in html)
    assert any("memtorch-advice" in h for h in html)
    assert any("memtorch.estimate on cpu" in h for h in html)
    assert len(png) >= 3 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in png)


def test_committed_notebook_holds_its_outputs():
    _check(nbformat.read(NOTEBOOK, as_version=4))


@pytest.mark.slow
def test_notebook_executes(tmp_path):
    path = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    _check(nb)
