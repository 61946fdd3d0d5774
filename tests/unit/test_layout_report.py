"""tools/layout_report.py on a small tree written here: line counts, the largest module and
function, the import graph between packages (installed name, relative, plain and by name),
and --check's exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import layout_report

REPO = Path(__file__).resolve().parents[2]

#: A function of 63 lines: `def` line, 61 statements, `return`.
BIG = "    def big(self):\n" + "        x = 0\n" * 61 + "        return x\n"

TREE = {
    # orchestrator: 1 + 83 lines
    "orchestrator/__init__.py": "from .core import Engine\n",
    "orchestrator/core.py": (
        "import os\n"                                         # 1: not a package
        "from lmcache_loadback.connectors import wire\n"      # 2: -> connectors
        "from ..metrics import server\n"                      # 3: -> metrics (relative)
        "import connectors.transport\n"                       # 4: -> connectors (plain)
        "from . import helpers\n"                             # 5: same package
        "\n"
        "\n"
        "def small():\n"                                      # 8: 2 lines
        "    return 1\n"
        "\n"
        "\n"
        "class Engine:\n"
        + BIG +                                               # 13..75: 63 lines
        "\n"
        "    def lazy(self):\n"                               # 77: 3 lines
        "        from lmcache_loadback.testing import fake\n"  # -> testing, lazy
        "        return fake\n"
        "\n"
        "\n"
        "def by_name():\n"                                    # 82: 2 lines
        "    return _run_tool(\"lmcache_loadback.harness.tool\")\n"
    ),
    "orchestrator/helpers.py": "HELP = 1\n",
    # connectors: 0 + 401 + 1 lines
    "connectors/__init__.py": "",
    "connectors/wire.py": "X = 1\n" + "# padding\n" * 400,
    "connectors/transport.py": "from . import wire\n",
    "metrics/server.py": "PORT = 0\n",
    # engines: a sub-folder, imports three levels up and from the import name's root
    "engines/sglang/__init__.py": "from ...orchestrator import core\nfrom . import cache\n",
    "engines/sglang/cache.py": "from lmcache_loadback import orchestrator, metrics\n",
    "harness/tool.py": "import importlib\n\n\ndef run():\n"
                       "    return importlib.import_module(f\"lmcache_loadback.testing.{1}\")\n",
    "testing/fake.py": "from lmcache_loadback.connectors.wire import X\n",
    # another top-level folder with code: a package, listed after the known ones
    "extra/mod.py": "import metrics\n"
                    "DEMOS = {\"sim\": \"lmcache_loadback.harness.tool\"}  # a table of names\n",
    "extra/broken.py": "def (:\n  pass\n",
    # never packages
    "tests/test_x.py": "import orchestrator\n" + "# t\n" * 500,
    "tools/t.py": "import orchestrator\n",
    "docs/conf.py": "import orchestrator\n",
    ".venv/lib/site.py": "import orchestrator\n",
    "venv2/pyvenv.cfg": "home = /usr\n",
    "venv2/lib/x.py": "import orchestrator\n",
    "lmcache_loadback.egg-info/x.py": "import orchestrator\n",
    "setup.py": "import orchestrator\n",
    "configs/alerts.yaml": "groups: []\n",
}


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return write(tmp_path / "repo", TREE)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.layout_report", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_packages_are_the_code_folders_minus_tests_tools_and_environments(tree):
    layout = layout_report.analyse(tree)
    assert layout.packages == ["orchestrator", "connectors", "metrics", "engines", "harness",
                               "testing", "extra"]
    assert sorted(m.path for m in layout.modules if m.package == "engines") == [
        "engines/sglang/__init__.py", "engines/sglang/cache.py"]


def test_lines_per_package_and_sub_folder(tree):
    layout = layout_report.analyse(tree)
    assert layout.package_totals() == {
        "orchestrator": (3, 1 + 83 + 1), "connectors": (3, 0 + 401 + 1), "metrics": (1, 1),
        "engines": (2, 2 + 1), "harness": (1, 5), "testing": (1, 1), "extra": (2, 2 + 2)}
    assert layout.folder_totals("engines") == {"engines/sglang": (2, 3)}
    assert layout.folder_totals("orchestrator") == {}


def test_largest_module_and_function(tree):
    layout = layout_report.analyse(tree)
    assert [(m.path, m.lines) for m in layout.largest_modules(2)] == [
        ("connectors/wire.py", 401), ("orchestrator/core.py", 83)]
    top = layout.largest_functions(3)
    assert [(f.module, f.qualname, f.line, f.lines) for f in top] == [
        ("orchestrator/core.py", "Engine.big", 13, 63),
        ("orchestrator/core.py", "Engine.lazy", 77, 3),
        ("harness/tool.py", "run", 4, 2)]  # ties: by module, then line
    sizes = {(f.module, f.qualname): f.lines for f in layout.largest_functions()}
    assert sizes == {("orchestrator/core.py", "Engine.big"): 63,
                     ("orchestrator/core.py", "Engine.lazy"): 3,
                     ("orchestrator/core.py", "small"): 2,
                     ("orchestrator/core.py", "by_name"): 2,
                     ("harness/tool.py", "run"): 2}
    broken = [m for m in layout.modules if m.error]
    assert [m.path for m in broken] == ["extra/broken.py"]


def test_import_graph_reads_installed_relative_and_plain_names(tree):
    layout = layout_report.analyse(tree)
    assert layout.edges() == {
        ("orchestrator", "connectors"): (2, 0),
        ("orchestrator", "metrics"): (1, 0),
        ("orchestrator", "testing"): (1, 1),
        ("engines", "orchestrator"): (2, 0),
        ("engines", "metrics"): (1, 0),
        ("testing", "connectors"): (1, 0),
        ("extra", "metrics"): (1, 0),
    }
    assert layout.named_edges() == {("orchestrator", "harness"): 1, ("harness", "testing"): 1,
                                    ("extra", "harness"): 1}


def test_report_prints_every_part(tree):
    out = run(str(tree))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "(a) lines per package" in text
    assert "largest module:   connectors/wire.py (401 lines)" in text
    assert "largest function: orchestrator/core.py:Engine.big (line 13), 63 lines" in text
    assert "orchestrator -> connectors" in text and "engines/sglang" in text
    assert "check:" not in text


def test_check_lists_every_module_and_function_over_the_limits(tree):
    out = run(str(tree), "--check")
    assert out.returncode == 1, out.stdout + out.stderr
    check = out.stdout.split("\ncheck: ", 1)[1]
    assert check.splitlines()[0] == "1 modules over 400 lines, 1 functions over 60 lines"
    assert "connectors/wire.py" in check and "Engine.big" in check
    assert "orchestrator/core.py " not in check  # 83 lines: under the limit


def test_check_passes_under_the_limits(tree, tmp_path):
    assert run(str(tree), "--check", "--max-module-lines", "401",
               "--max-function-lines", "63").returncode == 0
    small = write(tmp_path / "small", {"orchestrator/a.py": "def f():\n    return 1\n"})
    out = run(str(small), "--check")
    assert out.returncode == 0, out.stdout
    assert "check: ok" in out.stdout


def test_top_limits_the_lists_and_a_missing_root_is_usage(tree, tmp_path):
    out = run(str(tree), "--top", "1")
    assert out.returncode == 0
    assert "the 1 largest modules" in out.stdout and "83  orchestrator/core.py" not in out.stdout
    assert run(str(tmp_path / "nowhere")).returncode == 2


def test_the_product_itself_keeps_the_limits():
    """No product module over 400 lines, no function over 60: the house rule, kept by CI."""
    r = subprocess.run([sys.executable, "-m", "tools.layout_report", "--check", str(REPO)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


#: The core: what an engine's process imports. The edge (cli/, harness/, testing/, engines/)
#: imports it, never the other way round.
CORE = ("orchestrator", "connectors", "metrics")


def test_the_core_imports_nothing_from_the_edge_not_even_by_name():
    """The `loadback` CLI lives in cli/: the core names no harness, testing, engine or CLI
    module, neither in an import statement nor in a string imported at run time."""
    layout = layout_report.analyse(REPO)
    outward = [(src, dst) for src, dst in [*layout.edges(), *layout.named_edges()]
               if src in CORE and dst not in CORE]
    assert outward == []
    assert "cli" in layout.packages and ("cli", "orchestrator") in layout.edges()
