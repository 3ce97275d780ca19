"""Every code block in README.md and docs/*.md runs in CI.

Fences:

- ```python blocks run in this process (CPU: Triton kernels in the interpreter, as
  everywhere in the tests), each in a fresh namespace holding PREAMBLE below, with a fresh
  temporary folder as the working directory. Tracebacks name the page and its line.
- ```bash blocks run with ``bash -e -o pipefail`` at the repository root, without
  TRITON_INTERPRET (the production CPU path, as a user's shell would run them), with
  TMPDIR a fresh temporary folder: a block writes its outputs under ``$(mktemp -d)`` (or
  the ignored ``benchmarks/out/``), never into tracked files or a fixed path such as
  /tmp/x that another run could share.
- Anything else (```text for signatures and listings, ```diff) is prose and does not run.
  The near-misses ```py, ```python3, ```sh, ```shell and ```console are refused, so a
  block cannot drop out of CI by its spelling.

Markers, an HTML comment on the line right before the fence (invisible on GitHub):

- ``<!-- requires: cuda -->``, ``<!-- requires: torchrun -->`` or both
  (``<!-- requires: cuda, torchrun -->``): the block needs a CUDA device or a
  multi-process launch. A cuda block runs where CUDA is present (the preamble's batches
  are then on the GPU); a torchrun block never runs here. Either must sit next to a
  CPU variant: the code block right after or right before it has the same language and
  no marker, and so runs (the same code on CPU tensors, or in a one-process gloo world).
- ``<!-- ci: skip (reason) -->``: bash only, for commands that take minutes (the full
  benchmark, the whole test suite) or install packages. The reason is required and the
  number of such blocks is capped by MAX_SKIPPED.

PREAMBLE stands for the user's own model, data and loss in the snippets that use them
(``build_model()``, ``loader``, ``criterion``, ``local_rank``): a small CNN with a
BatchNorm, two batches of four 3x8x8 images with labels from 10 classes, and
cross-entropy. Everything else a block uses it imports or defines itself.

README.md links every docs page; relative links between the pages (and to files of the
repository), with their #anchors, must resolve.
"""
import os
import pathlib
import re
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(requires|ci):\s*(.*?)\s*-->\s*\Z")
REFUSED = {"py", "python3", "sh", "shell", "console"}
REQUIREMENTS = {"cuda", "torchrun"}
MAX_SKIPPED = 2

PREAMBLE = """
import torch
from torch import nn

torch.manual_seed(0)

def build_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

loader = [(torch.randn(4, 3, 8, 8, device=DEVICE), torch.randint(0, 10, (4,), device=DEVICE))
          for _ in range(2)]
criterion = nn.CrossEntropyLoss()
local_rank = 0
"""


class Block:
    def __init__(self, page, lang, code, line, marker):
        self.page, self.lang, self.code, self.line = page, lang, code, line
        self.kind, self.arg = marker if marker else (None, None)

    @property
    def where(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def requires(self):
        if self.kind != "requires":
            return set()
        return {r.strip() for r in self.arg.split(",")}


def _page_blocks(page):
    text = page.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text.count("\n", 0, m.start()) + 2          # first line of the code
        blocks.append(Block(page, m.group(1), m.group(2), line,
                            marker.groups() if marker else None))
    return blocks


BLOCKS = [b for page in PAGES for b in _page_blocks(page)]


def _params(lang):
    return [pytest.param(b, id=b.where) for b in BLOCKS if b.lang == lang]


def _unmet(block):
    unmet = set(block.requires)
    if torch.cuda.is_available():
        unmet.discard("cuda")
    return unmet


@pytest.mark.parametrize("block", _params("python"))
def test_python_block_runs(block, tmp_path, monkeypatch):
    unmet = _unmet(block)
    if unmet:
        pytest.skip(f"needs {', '.join(sorted(unmet))}; its CPU variant runs instead")
    device = "cuda" if "cuda" in block.requires else "cpu"
    namespace = {"__name__": "__docs__", "DEVICE": device}
    monkeypatch.chdir(tmp_path)
    exec(compile(PREAMBLE, "<docs preamble>", "exec"), namespace)
    code = "\n" * (block.line - 1) + block.code      # tracebacks show the page's own lines
    try:
        exec(compile(code, str(block.page), "exec"), namespace)
    finally:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("block", _params("bash"))
def test_bash_block_runs(block, tmp_path):
    unmet = _unmet(block)
    if unmet:
        pytest.skip(f"needs {', '.join(sorted(unmet))}; its CPU variant runs instead")
    if block.kind == "ci":
        pytest.skip(block.arg)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TMPDIR"] = str(tmp_path)                      # mktemp -d: a folder of this test's own
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_markers_are_known():
    for b in BLOCKS:
        assert b.lang not in REFUSED, f"{b.where}: ```{b.lang} does not run; write ```python or ```bash"
        if b.kind == "requires":
            assert b.requires and b.requires <= REQUIREMENTS, f"{b.where}: requires {b.arg!r}"
            assert b.lang in ("python", "bash"), f"{b.where}: a marker on ```{b.lang}"
        if b.kind == "ci":
            assert b.lang == "bash", f"{b.where}: only bash blocks may be skipped; python blocks run"
            assert re.fullmatch(r"skip \(.+\)", b.arg), f"{b.where}: write <!-- ci: skip (reason) -->"
    skipped = [b.where for b in BLOCKS if b.kind == "ci"]
    assert len(skipped) <= MAX_SKIPPED, f"too many blocks skipped in CI: {skipped}"


def test_every_gated_block_has_a_cpu_variant():
    for page in PAGES:
        blocks = _page_blocks(page)
        for i, b in enumerate(blocks):
            if not b.requires:
                continue
            neighbours = [blocks[j] for j in (i + 1, i - 1) if 0 <= j < len(blocks)]
            assert any(n.lang == b.lang and n.kind is None for n in neighbours), (
                f"{b.where}: a block that needs {', '.join(sorted(b.requires))} is followed "
                f"(or preceded) by a CPU variant that runs: a ```{b.lang} block with no marker")


def test_relative_links_resolve():
    """Links between pages (and to files in the repository) and their #anchors exist."""
    link = re.compile(r"\]\(([^)\s]*)\)")
    broken = []
    for page in PAGES:
        for href in link.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", href):
                continue
            target, _, anchor = href.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {href}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)} -> {href} (no such heading)")
    assert not broken, sorted(set(broken))


def _anchors(path):
    heads = re.findall(r"^#+\s+(.*)$", FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if f"](docs/{p.name})" not in readme]
    assert not missing, f"README.md's Documentation list lacks {missing}"
