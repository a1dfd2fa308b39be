"""The notebooks run top to bottom on the current Python, in a temporary folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs every notebook, which export models

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
MAX_COMMITTED_OUTPUT_CHARS = 20_000


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_there_are_notebooks():
    """The three notebooks the README names, and every notebook is one the README lists."""
    names = [p.name for p in notebook_paths()]
    assert names == ["01_export_and_parity.ipynb", "02_document_qa_cascade.ipynb", "03_quantization.ipynb"]
    readme = (NOTEBOOKS.parent / "README.md").read_text()
    assert all(f"{name[:2]} " in readme or name in readme for name in names)


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.name)
def test_notebook_is_committed_small(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    size = sum(len(str(o)) for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
    assert size <= MAX_COMMITTED_OUTPUT_CHARS, "clear the notebook's outputs before committing it"


CELL_TIMEOUT_S = 1200


# the quantization notebook exports and evaluates SmolLM2 six times: it is in the long tier
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.long) if p.name == "03_quantization.ipynb" else p
                                  for p in notebook_paths()], ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")

    work = tmp_path / path.stem
    work.mkdir()
    shutil.copy(path, work / path.name)
    nb = nbformat.read(str(work / path.name), as_version=4)
    # kernel "python3" from ipykernel: jupyter_client starts it with this interpreter (sys.executable)
    # a cell may export and evaluate SmolLM2: the limit only catches a hung kernel, not a slow machine
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(work)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails

    text = "\n".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    if path.name == "01_export_and_parity.ipynb":
        assert "torch fp32 vs transformers fp32: max |diff|" in text and "mil fp16 vs transformers fp32" in text
        assert "identical over" in text
        assert (work / "notebook_work" / "parity.png").stat().st_size > 1000
        assert (work / "notebook_work" / "export" / "manifest.json").is_file()
    if path.name == "03_quantization.ipynb":
        assert text.count("MB  perplexity") == 6 and "the fp16 size" in text
        assert (work / "notebook_work" / "quantization.png").stat().st_size > 1000
    if path.name == "02_document_qa_cascade.ipynb":
        assert text.count("identical to decoding alone: True") == 5 and "False" not in text
        assert (work / "notebook_work" / "bytes_read.png").stat().st_size > 1000
