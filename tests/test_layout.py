"""The package's import graph, read from the source with `ast` (nothing is imported).

The package lives in `src/tfgrpo/` (the src layout: a module's import name is its path under `src/`). Each
subpackage with its own floor is one folder: `base/` at the bottom, then `signatures/`, `programs/`, `optimizers/`
and `tasks/`, with the modules of `tfgrpo/` itself (the CLI, configs, tracking, reports) on top. Imports between
floors must form no cycle; an import inside a function of a tfgrpo module is allowed only with a reason below, never
to dodge a cycle; importing a module changes nothing outside it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
FLOORS = ("tfgrpo.base", "tfgrpo.signatures", "tfgrpo.programs", "tfgrpo.optimizers", "tfgrpo.tasks")

# (importer, imported) -> why the import waits for a call; "*" stands for any tfgrpo module
DEFERRED = {
    ("tfgrpo.cli", "*"): "a command imports dspy and the optimizer (seconds) only when it runs: --help and a bad "
                         "config answer at once",
    ("tfgrpo.task", "*"): "a task's modules and their optional dependencies load only when that task is picked",
    ("tfgrpo.tracking", "tfgrpo.plots"): "matplotlib, only for a compile that is tracked",
    ("tfgrpo.tracking", "tfgrpo.report"): "report imports matplotlib (plots): only for a compile that is tracked",
    ("tfgrpo.learned", "tfgrpo.evaluate"): "dspy, only when a shipped program is scored: the CLI, which names the "
                                           "shipped programs in its help, and `tfgrpo show` answer at once",
    ("tfgrpo.learned", "tfgrpo.lms"): "dspy, as for tfgrpo.evaluate: only when a shipped program is scored",
}


def module_name(path: Path) -> str:
    """`src/tfgrpo/optimizers/step.py` -> `tfgrpo.optimizers.step`: the path under `src/` is the import name."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> str:
    """The floor a module lives on: its subpackage of FLOORS, else `tfgrpo` itself."""
    return next((n for n in FLOORS if module == n or module.startswith(n + ".")), "tfgrpo")


MODULES = {module_name(p): p for p in (SRC / "tfgrpo").rglob("*.py")}


def imports(module: str, *, annotations: bool = False) -> list[tuple[str, int, bool]]:
    """(imported tfgrpo module, line, inside a function) for each import of `module` (`annotations`: those made for
    type annotations only, under `if TYPE_CHECKING:`, too)."""
    path, found = MODULES[module], []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") \
                    and not annotations:
                continue  # names for annotations only: never imported when the program runs
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, deferred) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, or from a package above it
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in child.names:  # `from tfgrpo.base import hooks` imports the module tfgrpo.base.hooks
                    name = f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                    found.append((name, child.lineno, deferred))
            visit(child, deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return [(name, line, deferred) for name, line, deferred in found if name.split(".")[0] == "tfgrpo"]


EDGES = sorted({(m, target, line, deferred) for m in MODULES for target, line, deferred in imports(m)})


def reaches(graph: dict, a: str, b: str, seen: frozenset = frozenset()) -> bool:
    """Whether `graph` (module or folder -> what it imports) leads from `a` to `b`."""
    return a == b or any(n not in seen and reaches(graph, n, b, seen | {n}) for n in graph[a])


def test_every_import_names_a_module_that_exists():
    missing = [f"{m}:{line} imports {t}" for m, t, line, _ in EDGES if t not in MODULES]
    assert not missing, "\n".join(missing)


def test_no_cycle_between_folders():
    graph, examples = defaultdict(set), defaultdict(list)
    for m, t, line, _ in EDGES:
        if floor(m) != floor(t):
            graph[floor(m)].add(floor(t))
            examples[floor(m), floor(t)].append(f"{m}:{line} -> {t}")

    cycle = sorted(pair for pair in examples if reaches(graph, pair[1], pair[0]))  # both ways: a cycle
    assert not cycle, "the folders import each other in a cycle:\n" + "\n".join(
        f"{a} -> {b}: " + ", ".join(examples[a, b][:3]) + (" ..." if len(examples[a, b]) > 3 else "") for a, b in cycle)


def test_the_base_imports_nothing_above_it():
    up = [f"{m}:{line} -> {t}" for m, t, line, _ in EDGES if floor(m) == "tfgrpo.base" and floor(t) != "tfgrpo.base"]
    assert not up, "\n".join(up)


def test_no_cycle_between_modules():
    """Top-level imports only: a cycle there would leave a module half-initialised while another reads it."""
    graph = defaultdict(set)
    for m, t, _, deferred in EDGES:
        if not deferred and t != m:
            graph[m].add(t)
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_the_optimizer_modules_import_one_way():
    """In `optimizers/`, no two modules need each other, not even for an annotation or inside a function: a reader
    goes down the imports from the step and never comes back up."""
    folder = [m for m in MODULES if m.startswith("tfgrpo.optimizers.")]
    graph = {m: {t for t, _, _ in imports(m, annotations=True) if t in folder and t != m} for m in folder}

    both = sorted(f"{m} <-> {t}" for m in folder for t in graph[m] if reaches(graph, t, m))
    assert not both, "modules of optimizers/ in an import circle:\n" + "\n".join(both)


def test_a_deferred_import_says_why():
    used, unexplained = set(), []
    for m, t, line, deferred in EDGES:
        if deferred:
            key = next((k for k in ((m, t), (m, "*")) if k in DEFERRED), None)
            if key is None:
                unexplained.append(f"{m}:{line} imports {t} inside a function")
            used.add(key)
    assert not unexplained, ("move these imports to the top of the module, or give the reason in DEFERRED "
                             "(never a cycle: import from a lower floor instead):\n" + "\n".join(unexplained))
    assert not set(DEFERRED) - used, f"DEFERRED lists imports that are gone: {sorted(set(DEFERRED) - used)}"


def test_importing_changes_nothing_outside_the_module():
    """No call whose result is dropped and no assignment into another object (os.environ, a patched class) at
    module level, outside `if __name__ == "__main__":`."""
    found = []

    def walk(body: list[ast.stmt], path: Path) -> None:
        own = {n.name for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}  # the module's own objects
        for node in body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            call = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            if call and ast.unparse(node.value.func).endswith("add_typer"):  # the CLI assembling its own app
                call = False
            outside = [t for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))
                       and not (isinstance(t.value, ast.Name) and t.value.id in own)]
            if call or outside:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
            if isinstance(node, ast.If) and "__main__" not in ast.unparse(node.test):
                walk(node.body + node.orelse, path)
            elif isinstance(node, ast.Try):
                walk(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body], path)

    for path in MODULES.values():
        walk(ast.parse(path.read_text()).body, path)
    assert not found, "\n".join(found)


def test_the_package_does_not_import_the_repository_around_it():
    """Modules import `tfgrpo.*`, never a folder of the repository by its own name (`benchmarks`, `tests`)."""
    local = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    found = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found += [f"{m}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in local - {"tfgrpo"}]
    assert not found, "\n".join(found)


def _unpacked_parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters `fn` unpacks as tuples in its own body (`(a, b), c = made, spent`): arguments packed to be
    unpacked again, which should have been parameters of their own."""
    params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    found = []
    for node in ast.walk(fn):
        for target in node.targets if isinstance(node, ast.Assign) else []:
            pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                node.value, ast.Tuple) and len(target.elts) == len(node.value.elts) else [(target, node.value)]
            found += [v.id for t, v in pairs if isinstance(t, ast.Tuple) and isinstance(v, ast.Name) and v.id in params]
    return found


def test_the_optimizer_reads_as_plain_python():
    """src/tfgrpo/optimizers/: no parameter packed as a tuple only to be unpacked again, no lambda bound to a name where a
    function belongs, no `__new__` on the optimizer, no call of another object's private method."""
    found = []
    for path in sorted((SRC / "tfgrpo" / "optimizers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.name}:{node.lineno}: {node.name} unpacks its parameter {p}"
                          for p in _unpacked_parameters(node)]
                if node.name == "__new__":
                    found.append(f"{path.name}:{node.lineno}: a __new__")
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Lambda):
                found.append(f"{path.name}:{node.lineno}: a lambda bound to a name: {ast.unparse(node)[:60]}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                private = name.startswith("_") and not name.startswith("__")
                if private and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    found.append(f"{path.name}:{node.lineno}: calls another object's private {ast.unparse(node.func)}")
    assert not found, "\n".join(found)


def test_the_check_for_packed_parameters_sees_them():
    packed = ast.parse("def f(run, made, spent, pair):\n    (a, b), (c, d) = made, spent\n    x, y = pair\n"
                       "    self.run, z = run, run.pair").body[0]
    assert _unpacked_parameters(packed) == ["made", "spent", "pair"]


def test_the_folders_are_the_package():
    """No `package-dir` map: pyproject.toml finds the packages under `src/`, so each folder of Python files there must
    be a package of its own (an `__init__.py`), or setuptools would leave it out of the wheel."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "package-dir" not in pyproject and 'where = ["src"]' in pyproject
    loose = sorted(str(d.relative_to(ROOT)) for d in (SRC / "tfgrpo").rglob("*") if d.is_dir()
                   and any(d.glob("*.py")) and not (d / "__init__.py").exists())
    assert not loose, f"folders of Python files that are not packages: {loose}"
