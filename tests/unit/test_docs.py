"""The docs cite only what the repository has, and the README starts with its two commands.

Checked in README.md, DESIGN.md and docs/*.md, outside fenced code blocks:
- every repository-relative path written in backticks exists. A word of a code span counts as
  such a path when it contains a `/` and ends in a known extension or in `/`, or starts with a
  top-level entry of the repository (`tests/sglang`); a bare file name (`test_tp.py`) counts
  when it ends in .py, .md, .sh, .toml or .cfg, and must then be the name of some file here.
  URLs, absolute paths (`/metrics`), flags, `HOST:PORT`-style words, placeholders (`<port>`,
  `{i}`, `PATH/config.json`) and machine-local folders that start with a dot and are not in
  the repository (`.whl/`, `.venv-sglang-0.5.23/`) are not paths here. A `*` is a glob that
  must match something.
- every markdown link target that is not a URL exists, relative to the document, and an
  `#anchor` names a heading of the document it points at (GitHub's heading ids).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Extensions that make a word with a / a path.
EXTENSIONS = frozenset({".py", ".md", ".yaml", ".yml", ".json", ".toml", ".txt", ".sh", ".cfg",
                        ".in", ".ini", ".rst"})
#: Extensions that make a bare name (no /) a file that must exist somewhere in the repository;
#: other bare names (`loadback.yaml`, `config.json`) are as often the user's own files.
BARE_EXTENSIONS = frozenset({".py", ".md", ".sh", ".toml", ".cfg"})
#: Characters no path here contains: placeholders, shell syntax, URLs, entry points.
NOT_A_PATH = re.compile(r"[<>{}$|=:@\\]|\.\.\.")
PLACEHOLDER_SEGMENT = re.compile(r"^[A-Z][A-Z_]*$")  # PATH, FILE, DIR, HOST
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SKIP_DIRS = frozenset({".git", "__pycache__", "node_modules", "build", "dist"})


def documents(root: Path = REPO) -> list[Path]:
    return [root / "README.md", root / "DESIGN.md", *sorted((root / "docs").glob("*.md"))]


def prose(text: str) -> list[str]:
    """The document's lines with fenced code blocks blanked out."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def code_spans(text: str) -> list[str]:
    """Inline code spans (a span may wrap onto the next line of its paragraph)."""
    spans = []
    for paragraph in re.split(r"\n\s*\n", "\n".join(prose(text))):
        spans += [m.group(2).strip() for m in CODE_SPAN.finditer(paragraph)]
    return spans


def link_targets(text: str) -> list[str]:
    return [m.group(1) for line in prose(text) for m in LINK.finditer(line)]


def slug(heading: str) -> str:
    """GitHub's id for a heading: the rendered text, lower case, punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _clean(word: str) -> str:
    word = word.strip("'\"()[],;").rstrip(".")
    word = word.split("::", 1)[0]            # pytest node ids
    return re.sub(r":\d+(-\d+)?$", "", word)  # path:line


def path_candidates(span: str, root: Path = REPO) -> list[str]:
    """The words of one code span that are repository paths (module docstring)."""
    top = {p.name for p in root.iterdir()} if root.is_dir() else set()
    found = []
    for raw in span.split():
        word = _clean(raw)
        if (not word or word.startswith(("/", "~", "-", "http")) or NOT_A_PATH.search(word)
                or any(PLACEHOLDER_SEGMENT.match(seg) for seg in word.split("/") if seg)):
            continue
        first = word.split("/", 1)[0]
        if first.startswith(".") and first not in top:
            continue  # a machine-local folder: a venv, carried wheels
        suffix = Path(word.rstrip("/")).suffix
        if "/" in word:
            if suffix in EXTENSIONS or word.endswith("/") or first in top:
                found.append(word)
        elif suffix in BARE_EXTENSIONS:
            found.append(word)
    return found


def _file_names(root: Path) -> list[str]:
    """Every file name under root, outside hidden folders, virtual environments and build
    output."""
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames
                       if d not in SKIP_DIRS and not d.startswith(".")
                       and not d.endswith(".egg-info") and not (here / d / "pyvenv.cfg").exists()]
        names += filenames
    return names


def missing_paths(doc: Path, root: Path = REPO) -> list[str]:
    text = doc.read_text()
    names = None
    out = []
    for span in code_spans(text):
        for word in path_candidates(span, root):
            if "/" in word:
                ok = (any(root.glob(word.rstrip("/"))) if "*" in word
                      else (root / word).exists())
            else:
                if names is None:
                    names = _file_names(root)
                pattern = re.compile(re.escape(word).replace(r"\*", ".*") + "$")
                ok = any(pattern.match(n) for n in names)
            if not ok:
                out.append(f"`{word}`")
    return out


def broken_links(doc: Path) -> list[str]:
    text = doc.read_text()
    out = []
    for target in link_targets(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        where, _, anchor = target.partition("#")
        dest = (doc.parent / where).resolve() if where else doc
        if not dest.exists():
            out.append(f"({target}): no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            out.append(f"({target}): no heading with that id in {dest.name}")
    return out


# ---- the repository's documents ----

@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_path_exists(doc):
    assert doc.exists()
    assert missing_paths(doc) == []


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(doc):
    assert broken_links(doc) == []


def test_docs_folder_has_documents():
    assert len(documents()) > 3


def test_readme_starts_with_the_two_commands():
    head = "\n".join((REPO / "README.md").read_text().splitlines()[:30])
    assert "make demo" in head
    assert "make test" in head


# ---- the checker itself ----

def test_a_missing_path_is_reported_and_non_paths_are_not(tmp_path):
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "states.py").write_text("")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "x.md"
    doc.write_text(
        "Real: `orchestrator/states.py`, `orchestrator/`, `states.py`, `orchestrator/*.py`,\n"
        "`python -m pytest orchestrator/states.py::test_x`, `orchestrator/states.py:12`.\n"
        "Missing: `orchestrator/gone.py`, `reference/lmcache-mp.md`, `gone.py`,\n"
        "`orchestrator/hook`, `python -m pytest\n"
        "reference/x.py`.\n"
        "Not paths: `/metrics`, `http://a/b.py`, `tcp://127.0.0.1:5555`, `HOST:PORT`,\n"
        "`--model-config PATH/config.json`, `<dir>/x.py`, `e{i}/x`, `k_buffer/v_buffer`,\n"
        "`.venv-sglang-0.5.23/bin/python`, `loadback.yaml`, `config.json`, `torch.cuda.Event`,\n"
        "`lmcache_loadback.engines.sglang:register`, `bench client|core|gpu`, `tokens / 1024`.\n"
        "\n```bash\ncat fenced/missing.py\n```\n")
    assert missing_paths(doc, tmp_path) == [
        "`orchestrator/gone.py`", "`reference/lmcache-mp.md`", "`gone.py`",
        "`orchestrator/hook`", "`reference/x.py`"]


def test_links_and_anchors_are_checked(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n## On a GPU: `loadback bench gpu` (H200)\n## Same\n## Same\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#on-a-gpu-loadback-bench-gpu-h200) [ok](docs/a.md#same-1)\n"
        "[web](https://example.com/x.md) [self](#top)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nowhere)\n\n# Top\n")
    assert broken_links(doc) == ["(docs/b.md): no such file",
                                 "(docs/a.md#nowhere): no heading with that id in a.md"]
