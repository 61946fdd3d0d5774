"""How the code is laid out: lines per package, the largest modules and functions, and who
imports whom between the top-level packages.

    python -m tools.layout_report [ROOT] [--top N] [--check]

ROOT (default: the checkout this file lives in) is a repository root. Its packages are the
top-level folders that hold .py files, apart from tests/, tools/, hidden folders, virtual
environments and build output: orchestrator, connectors, metrics, engines, harness,
testing and cli today; an older tree (the SGLang hook in orchestrator/hook, the harness in
orchestrator/tools) is read the same way, its sub-folders shown under their package.

Imports are read with `ast` from every import statement, including those inside functions
(counted apart as "lazy"): `lmcache_loadback.X...` (the installed name), relative imports
resolved against the module's own folder, and plain `X...` where X is one of the packages
(the layout before the one import name). Only edges between two different packages count.
Imports by name are counted apart: any string that is a module name under the import name
(`"lmcache_loadback.X..."`, an f-string's literal head too), and `import_module("X...")`.

`--check` exits 1 listing every module over --max-module-lines (400) and every function
over --max-function-lines (60), else 0. A function's size runs from its `def` line to its
last line, nested functions included (and also counted on their own).

Standard library only; it imports nothing from the product.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

IMPORT_NAME = "lmcache_loadback"
#: The packages in the order the report lists them; any other package follows, sorted.
KNOWN_ORDER = ("orchestrator", "connectors", "metrics", "engines", "harness", "testing", "cli")
#: Top-level folders that are never product packages.
EXCLUDED = frozenset({"tests", "tools", "build", "dist", "docs", "node_modules", "__pycache__"})
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
DEFAULT_ROOT = Path(__file__).resolve().parents[1]
#: A dotted module name, possibly cut short where an f-string's first field begins.
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\.?$")


@dataclass(frozen=True)
class Function:
    module: str        # repository-relative path of its module
    qualname: str      # Class.method, outer.inner
    line: int          # the `def` line
    lines: int         # def line to last line

    @property
    def where(self) -> str:
        return f"{self.module}:{self.qualname} (line {self.line})"


@dataclass
class Module:
    path: str          # repository-relative, with /
    package: str       # its top-level folder
    lines: int
    functions: list[Function] = field(default_factory=list)
    #: (target package, inside a function) per import of another package
    imports: list[tuple[str, bool]] = field(default_factory=list)
    #: target package per module named in a string (importlib.import_module("..."))
    by_name: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Layout:
    root: Path
    packages: list[str]
    modules: list[Module]

    def package_totals(self) -> dict[str, tuple[int, int]]:
        """package -> (modules, lines)."""
        out = {p: (0, 0) for p in self.packages}
        for m in self.modules:
            n, lines = out[m.package]
            out[m.package] = (n + 1, lines + m.lines)
        return out

    def folder_totals(self, package: str) -> dict[str, tuple[int, int]]:
        """package/sub -> (modules, lines), for each direct sub-folder holding modules."""
        out: dict[str, tuple[int, int]] = {}
        for m in self.modules:
            parts = m.path.split("/")
            if m.package == package and len(parts) > 2:
                key = "/".join(parts[:2])
                n, lines = out.get(key, (0, 0))
                out[key] = (n + 1, lines + m.lines)
        return dict(sorted(out.items()))

    def largest_modules(self, n: int | None = None) -> list[Module]:
        ranked = sorted(self.modules, key=lambda m: (-m.lines, m.path))
        return ranked if n is None else ranked[:n]

    def largest_functions(self, n: int | None = None) -> list[Function]:
        every = [f for m in self.modules for f in m.functions]
        ranked = sorted(every, key=lambda f: (-f.lines, f.module, f.line))
        return ranked if n is None else ranked[:n]

    def _sorted(self, counts: Counter) -> list[tuple[str, str]]:
        order = {p: i for i, p in enumerate(self.packages)}
        return sorted(counts, key=lambda k: (order[k[0]], order[k[1]]))

    def edges(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(from, to) -> (import statements, of which inside functions), in package order."""
        total: Counter = Counter()
        lazy: Counter = Counter()
        for m in self.modules:
            for target, inside in m.imports:
                total[(m.package, target)] += 1
                lazy[(m.package, target)] += inside
        return {k: (total[k], lazy[k]) for k in self._sorted(total)}

    def named_edges(self) -> dict[tuple[str, str], int]:
        """(from, to) -> modules of `to` that `from` imports by name at run time."""
        total: Counter = Counter((m.package, t) for m in self.modules for t in m.by_name)
        return {k: total[k] for k in self._sorted(total)}

    def violations(self, max_module: int = MAX_MODULE_LINES,
                   max_function: int = MAX_FUNCTION_LINES) -> tuple[list[Module], list[Function]]:
        return ([m for m in self.largest_modules() if m.lines > max_module],
                [f for f in self.largest_functions() if f.lines > max_function])


def _is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file()


def _skip_dir(name: str) -> bool:
    return name.startswith(".") or name == "__pycache__" or name.endswith(".egg-info")


def _py_files(folder: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d) and not _is_venv(here / d))
        found += [here / f for f in sorted(filenames) if f.endswith(".py")]
    return found


def find_packages(root: Path) -> list[str]:
    """The top-level folders of ROOT that hold product code."""
    names = [d.name for d in sorted(root.iterdir())
             if d.is_dir() and d.name not in EXCLUDED and not _skip_dir(d.name)
             and not _is_venv(d) and _py_files(d)]
    known = [p for p in KNOWN_ORDER if p in names]
    return known + sorted(n for n in names if n not in KNOWN_ORDER)


class _Reader(ast.NodeVisitor):
    """Collects a module's functions (qualified names, sizes) and its package imports."""

    def __init__(self, path: str, package_parts: tuple[str, ...], packages: frozenset[str]):
        self.path = path
        self.package_parts = package_parts
        self.packages = packages
        self.scope: list[str] = []
        self.depth = 0  # function nesting, for lazy imports
        self.functions: list[Function] = []
        self.imports: list[tuple[str, bool]] = []
        self.by_name: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        end = getattr(node, "end_lineno", None) or node.lineno
        self.functions.append(Function(self.path, ".".join(self.scope), node.lineno,
                                       end - node.lineno + 1))
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        self.scope.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def _add(self, target: str | None) -> None:
        if target in self.packages and target != self.package_parts[0]:
            self.imports.append((target, self.depth > 0))

    def _named(self, target: str) -> None:
        if target in self.packages and target != self.package_parts[0]:
            self.by_name.append(target)

    def visit_Constant(self, node: ast.Constant) -> None:
        """A string that is a module name under the import name, wherever it stands: handed
        to a call (`_run_tool("lmcache_loadback.harness.demo")`), kept in a table
        (`{"sim": "lmcache_loadback.harness.demo"}`) or an f-string's literal head."""
        text = node.value
        if isinstance(text, str) and _DOTTED.match(text):
            parts = text.split(".")
            if parts[0] == IMPORT_NAME and len(parts) > 1 and parts[1]:
                self._named(parts[1])

    def visit_Call(self, node: ast.Call) -> None:
        """`import_module("X...")` with X one of the packages (the layout before the one
        import name); names under the import name are read as constants."""
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        for arg in node.args[:1]:
            text = None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                text = arg.value
            elif (isinstance(arg, ast.JoinedStr) and arg.values
                  and isinstance(arg.values[0], ast.Constant)):
                text = str(arg.values[0].value)
            if name == "import_module" and text and _DOTTED.match(text) \
                    and text.split(".")[0] != IMPORT_NAME:
                self._named(text.split(".")[0])
        self.generic_visit(node)

    def _absolute(self, parts: list[str], names: list[str]) -> None:
        if parts and parts[0] == IMPORT_NAME:
            if len(parts) > 1:
                self._add(parts[1])
            else:  # from lmcache_loadback import orchestrator, connectors
                for name in names:
                    self._add(name)
        elif parts:
            self._add(parts[0])

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._absolute(alias.name.split("."), [])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = [a.name for a in node.names]
        module = node.module.split(".") if node.module else []
        if node.level == 0:
            self._absolute(module, names)
            return
        up = node.level - 1
        if up > len(self.package_parts):
            return  # above the import name's root: not this tree's
        base = list(self.package_parts[:len(self.package_parts) - up]) + module
        if base:
            self._add(base[0])
        else:  # from .. import connectors (at a package's top)
            for name in names:
                self._add(name)


def read_module(root: Path, path: Path, package: str, packages: frozenset[str]) -> Module:
    rel = path.relative_to(root).as_posix()
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")
    module = Module(rel, package, len(text.splitlines()))
    parts = tuple(rel.split("/")[:-1])  # the folder the module sits in: its package
    try:
        tree = ast.parse(data, filename=rel)
    except (SyntaxError, ValueError) as exc:
        module.error = f"{type(exc).__name__}: {exc}"
        return module
    reader = _Reader(rel, parts, packages)
    reader.visit(tree)
    module.functions = reader.functions
    module.imports = reader.imports
    module.by_name = reader.by_name
    return module


def analyse(root: Path | str) -> Layout:
    root = Path(root).resolve()
    packages = find_packages(root)
    names = frozenset(packages)
    modules = [read_module(root, path, package, names)
               for package in packages for path in _py_files(root / package)]
    return Layout(root, packages, modules)


def render(layout: Layout, top: int = 10) -> str:
    out = [f"layout of {layout.root}", "", "(a) lines per package",
           f"  {'package':<28} {'modules':>7} {'lines':>7}"]
    totals = layout.package_totals()
    for package, (n, lines) in totals.items():
        out.append(f"  {package:<28} {n:>7} {lines:>7}")
        for folder, (fn, flines) in layout.folder_totals(package).items():
            out.append(f"    {folder:<26} {fn:>7} {flines:>7}")
    out.append(f"  {'total':<28} {sum(n for n, _ in totals.values()):>7} "
               f"{sum(lines for _, lines in totals.values()):>7}")

    modules = layout.largest_modules(top)
    functions = layout.largest_functions(top)
    out += ["", "(b) largest module and function"]
    out.append(f"  largest module:   {modules[0].path} ({modules[0].lines} lines)" if modules
               else "  largest module:   none")
    out.append(f"  largest function: {functions[0].where}, {functions[0].lines} lines" if functions
               else "  largest function: none")
    out.append(f"  the {len(modules)} largest modules (lines):")
    out += [f"    {m.lines:>6}  {m.path}" for m in modules]
    out.append(f"  the {len(functions)} largest functions (lines, def to last line):")
    out += [f"    {f.lines:>6}  {f.where}" for f in functions]
    unparsed = [m for m in layout.modules if m.error]
    if unparsed:
        out.append("  not parsed (lines counted, no functions or imports):")
        out += [f"    {m.path}: {m.error}" for m in unparsed]

    out += ["", "(c) imports between packages (import statements; lazy = inside a function)"]
    edges = layout.edges()
    if not edges:
        out.append("  none")
    for (src, dst), (n, lazy) in edges.items():
        out.append(f"  {src + ' -> ' + dst:<30} {n:>5}" + (f"  ({lazy} lazy)" if lazy else ""))
    named = layout.named_edges()
    if named:
        out.append("  imported by name at run time (a module name in a string, not counted above):")
        out += [f"  {src + ' -> ' + dst:<30} {n:>5}" for (src, dst), n in named.items()]
    return "\n".join(out)


def render_check(modules: list[Module], functions: list[Function],
                 max_module: int, max_function: int) -> str:
    if not modules and not functions:
        return (f"check: ok (no module over {max_module} lines, "
                f"no function over {max_function} lines)")
    out = [f"check: {len(modules)} modules over {max_module} lines, "
           f"{len(functions)} functions over {max_function} lines"]
    out += [f"  module   {m.lines:>6}  {m.path}" for m in modules]
    out += [f"  function {f.lines:>6}  {f.where}" for f in functions]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.layout_report",
        description="Lines per package, largest modules and functions, imports between packages.")
    parser.add_argument("root", nargs="?", default=str(DEFAULT_ROOT),
                        help="repository root (default: this checkout)")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="how many of the largest modules and functions (default 10)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 listing every module and function over its limit")
    parser.add_argument("--max-module-lines", type=int, default=MAX_MODULE_LINES, metavar="N")
    parser.add_argument("--max-function-lines", type=int, default=MAX_FUNCTION_LINES, metavar="N")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not root.is_dir():
        parser.error(f"{root} is not a folder")
    if args.top < 1:
        parser.error("--top must be at least 1")
    layout = analyse(root)
    print(render(layout, args.top))
    if not args.check:
        return 0
    modules, functions = layout.violations(args.max_module_lines, args.max_function_lines)
    print()
    print(render_check(modules, functions, args.max_module_lines, args.max_function_lines))
    return 1 if modules or functions else 0


if __name__ == "__main__":
    sys.exit(main())
