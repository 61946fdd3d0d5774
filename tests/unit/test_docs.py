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
import shlex
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


# ---- what the docs name exists: commands, flags, make targets, devices ----
# Checked in README.md and docs/*.md, in code spans and fenced blocks alike (a command is a
# command wherever it is written).

#: `loadback` as a command: first in its span or line, after a shell prompt or a bin/ path.
LOADBACK_CMD = re.compile(r"(?:^[ \t]*|(?<=/)|(?<=\$ )|(?<=&& ))loadback[ \t]+(\S[^\n`;&#]*)",
                          re.M)
MAKE_CMD = re.compile(r"(?:^|(?<=[\s(`]))make[ \t]+((?:[A-Z_]+=\S*[ \t]+)*)([a-z][\w-]*)")
DAEMON_CMD = re.compile(r"(?:python -m lmcache\.v1\.multiprocess\.server|lmcache server)"
                        r"((?:[ \t]+[^\s`]+)*)")
PIP_BY_NAME = re.compile(r"pip install(?:[ \t]+-\S+)*[ \t]+['\"]?lmcache-loadback\b")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
CLI_DOCS = ("README.md", "docs")


def cli_documents(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def command_texts(text: str) -> list[str]:
    """Every code span and every fenced block's logical line (a trailing backslash joins the
    next): where the docs write commands."""
    out = code_spans(text)
    fenced, block = False, []
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            block.append(line)
    out += re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines()
    return out


def _subparsers(parser):
    import argparse

    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _positional_choices(parser):
    return [a for a in parser._actions
            if not a.option_strings and a.choices and not isinstance(a.choices, dict)]


def cli_errors(text: str, parser) -> list[str]:
    """Each `loadback ...` whose command, sub-command, listed choices or --flags the parser
    does not have. `a|b|c` for a positional with choices claims the whole list: it must name
    every choice. Words in capitals (COMMAND) are placeholders; a `loadback` that is a flag's
    value (`--radix-cache-backend loadback`) is not a command."""
    out = []
    for span in command_texts(text):
        for m in LOADBACK_CMD.finditer(span):
            before = span[:m.start()].split()
            if before and before[-1].startswith("-"):
                continue
            words = [w.strip("[]()") for w in m.group(1).replace("\\|", "|").split()]
            words = [w for w in words if w]
            p, path, i = parser, ["loadback"], 0
            while (sub := _subparsers(p)) and i < len(words) and not words[i].startswith("-") \
                    and not PLACEHOLDER_SEGMENT.match(words[i]):
                if words[i] not in sub.choices:
                    out.append(f"`{' '.join(path)} {words[i]}`: no such command")
                    break
                p = sub.choices[words[i]]
                path.append(words[i])
                i += 1
            else:
                for action in _positional_choices(p):
                    if i >= len(words) or words[i].startswith("-"):
                        break
                    named = words[i].split("|")
                    if any(n not in action.choices for n in named) or (
                            len(named) > 1 and set(named) != set(action.choices)):
                        out.append(f"`{' '.join(path)} {words[i]}`: the choices are "
                                   f"{'|'.join(action.choices)}")
                    i += 1
                known = set(p._option_string_actions)
                out += [f"`{' '.join(path)} {f}`: no such flag"
                        for f in FLAG.findall(" ".join(words[i:])) if f not in known]
    return out


def make_targets(makefile: Path) -> set[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.%/ -]+?)\s*:(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets


def make_errors(text: str, targets: set[str]) -> list[str]:
    return [f"`make {m.group(2)}`: no such target in the Makefile"
            for span in command_texts(text) for m in MAKE_CMD.finditer(span)
            if m.group(2) not in targets]


def device_errors(text: str, name: str, root: Path = REPO) -> list[str]:
    """While engines/vllm has its CUDA path, no sentence about vLLM says it is CPU-only."""
    if not (root / "engines" / "vllm" / "paged_cuda.py").exists():
        return []
    out = []
    for paragraph in re.split(r"\n\s*\n", "\n".join(prose(text))):
        for sentence in re.split(r"(?<=[.:;])\s+", " ".join(paragraph.split())):
            if ("vllm" in name or "vLLM" in sentence) and "CUDA" not in sentence and \
                    re.search(r"\bCPU\b[^.;]*\bonly\b|\bonly\b[^.;]*\bCPU\b", sentence):
                out.append(f"says CPU only for vLLM: {sentence[:120]!r}")
    return out


@pytest.mark.parametrize("doc", cli_documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_loadback_command_and_flag_named_exists(doc):
    from lmcache_loadback.cli import build_parser

    assert cli_errors(doc.read_text(), build_parser()) == []


@pytest.mark.parametrize("doc", cli_documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_target_named_exists(doc):
    assert make_errors(doc.read_text(), make_targets(REPO / "Makefile")) == []


@pytest.mark.parametrize("doc", cli_documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_doc_says_vllm_is_cpu_only_while_its_cuda_path_exists(doc):
    assert device_errors(doc.read_text(), doc.name) == []


@pytest.mark.parametrize("doc", cli_documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_doc_installs_the_product_by_name_from_the_package_index(doc):
    """lmcache-loadback is not on the package index: installs name a checkout or a wheel."""
    hits = [s for s in command_texts(doc.read_text()) if PIP_BY_NAME.search(s)]
    assert hits == []


def daemon_lines(root: Path = REPO) -> list[tuple[str, str]]:
    """(where, the arguments) of every daemon command line in the docs, and of the one
    `loadback tune` prints when it cannot reach the daemon."""
    from lmcache_loadback.harness.tune import daemon_command

    found = [(doc.name, m.group(1)) for doc in cli_documents(root)
             for span in command_texts(doc.read_text()) for m in DAEMON_CMD.finditer(span)
             if m.group(1).split() and "--help" not in m.group(1).split()]
    return found + [("loadback tune", DAEMON_CMD.search(daemon_command("HOST", 5555)).group(1))]


#: What the docs' placeholders stand for when a daemon line is parsed.
DAEMON_PLACEHOLDERS = {"HOST": "127.0.0.1", "PORT": "5555", "N": "256", "GB": "1",
                       "NAME": "loadback"}


def test_every_daemon_line_is_one_lmcache_0_5_6_starts_with():
    """The daemon's command lines (docs, `loadback tune`'s hint) parse with lmcache 0.5.6's own
    server arguments, and a whole line (no `...`) gives the daemon every flag it requires."""
    import argparse

    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.mp_observability.config import add_observability_args
    from lmcache.v1.multiprocess.config import add_coordinator_args, add_mp_server_args

    class Refused(Exception):
        pass

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise Refused(message)

    parser = Parser()  # what `python -m lmcache.v1.multiprocess.server` parses
    for add in (add_mp_server_args, add_storage_manager_args, add_observability_args,
                add_coordinator_args):
        add(parser)
    lines, bad = daemon_lines(), []
    for where, line in lines:
        # as the shell splits it: an --l2-adapter's JSON is one quoted word
        words = [DAEMON_PLACEHOLDERS.get(w, w) for w in shlex.split(line)]
        whole = "..." not in words
        try:
            args = parser.parse_args([w for w in words if w != "..."])
            if whole:
                parse_args_to_config(args)
        except (Refused, ValueError) as exc:
            bad.append(f"{where}: {line.strip()}: {exc}")
    assert any(where != "loadback tune" for where, _ in lines), "no doc gives the daemon's line"
    assert bad == []


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


def test_cli_make_and_device_checkers_report_what_is_missing(tmp_path):
    from lmcache_loadback.cli import build_parser

    text = ("`loadback bench client|core|gpu`, `loadback tune --daemon H:P --nope`,\n"
            "`loadback chaos walk`, `loadback COMMAND --help`, `loadback_lookups_total`,\n"
            "`--radix-cache-backend loadback`, `loadback config validate|show FILE`,\n"
            "`Skipping plugin loadback (not in SGLANG_PLUGINS)`, `$ loadback diagram`,\n"
            "`make demo ENGINE=vllm`, `make nowhere`.\n\n"
            "```bash\n.venv/bin/loadback status --url U \\\n    --jsn\n```\n")
    assert cli_errors(text, build_parser()) == [
        "`loadback bench client|core|gpu`: the choices are client|core|gpu|vllm|l2",
        "`loadback tune --nope`: no such flag", "`loadback chaos walk`: no such command",
        "`loadback status --jsn`: no such flag"]
    (tmp_path / "Makefile").write_text(".PHONY: demo\ndemo: venv\n\techo x: y\nX := 1\n")
    assert make_targets(tmp_path / "Makefile") == {".PHONY", "demo"}
    assert make_errors(text, {"demo"}) == ["`make nowhere`: no such target in the Makefile"]
    assert device_errors("- CPU KV cache only (vLLM's CPU layout).\n\n"
                         "MLA runs on CPU only.\n", "README.md")[0].startswith(
        "says CPU only for vLLM")
    assert device_errors("MLA runs on CPU only. vLLM: CPU and CUDA, not only CPU.\n",
                         "README.md") == []
    assert PIP_BY_NAME.search("pip install -q lmcache-loadback  # x")
    assert not PIP_BY_NAME.search("pip install dist/lmcache_loadback-0.1.0-py3-none-any.whl")
