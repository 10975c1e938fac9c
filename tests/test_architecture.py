"""The package stays readable: short functions, no monkeypatching at import time. (No cap on a module's lines:
a module holds one idea, as long as the idea needs.)"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "captioner"
MAX_FUNCTION_LINES = 60


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_functions_are_short():
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_module_level_monkeypatching():
    """No module assigns attributes of another object at import time (x.y = ... at top level)."""
    found = []
    for p in _modules():
        for node in ast.parse(p.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Attribute) for t in targets):
                found.append(f"{p.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"module-level attribute assignments: {found}"


# ---------------------------------------------------------------- the package by job (docs/architecture.md)
# Each folder is one job; a job imports only jobs of a lower rank (never its equals or its betters).
# "base" is the root's basics; api.py, the public face, sits above decoding and below the jobs that use it.
JOB_RANK = {"base": 0, "model": 1, "data": 2, "concepts": 2, "decoding": 3, "api": 4,
            "evaluation": 5, "training": 6, "ui": 6, "bench": 7, "cli": 8}
MAX_TOP_LEVEL_MODULES = 8


def _module_name(p: Path) -> str:
    parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(p: Path) -> set[str]:
    """Every captioner module `p` imports: top level, inside functions and under TYPE_CHECKING alike."""
    me = _module_name(p)
    pkg = me if p.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            out |= {n for n in names if n in _ALL} | ({target} if target in _ALL else set())
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in _ALL}
    return out - {me}


_ALL = {_module_name(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _job(module: str) -> str:
    parts = module.split(".")
    if module in ("captioner", "captioner.api"):  # the package's face re-exports api's names
        return "api"
    return parts[1] if len(parts) > 2 or parts[1] in JOB_RANK else "base"


def test_import_graph_has_no_cycle():
    graph = {_module_name(p): _imports(p) for p in _modules()}
    graph = {m: {t for t in deps if not (m.startswith(t + ".") and t != "captioner")} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            assert state.get(t) != 1, f"import cycle: {' -> '.join(path + [m, t])}"
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_job_imports_a_higher_job():
    upward = []
    for p in _modules():
        src = _module_name(p)
        for t in _imports(p):
            a, b = _job(src), _job(t)
            if a != b and JOB_RANK[b] >= JOB_RANK[a]:
                upward.append(f"{src} ({a}) -> {t} ({b})")
    assert not upward, "imports from a job to an equal or higher one:\n" + "\n".join(upward)


def test_the_package_root_keeps_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {top}; put new code in its job's folder"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(JOB_RANK), f"a folder without a rank in JOB_RANK: {folders - set(JOB_RANK)}"


def test_the_app_is_the_pages_layout_only():
    """app.py lays out the page (<= 300 lines): every panel is in captioner/ui/ and asks the library
    (Captioner.read -> Photo); the app imports no model, decoding or training code itself."""
    app = PACKAGE.parent / "app.py"
    assert len(app.read_text().splitlines()) <= 300  # the layout, not the logic
    imported = set()
    for node in ast.walk(ast.parse(app.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    ours = {m for m in imported if m.split(".")[0] == "captioner"}
    assert ours and all(m.startswith("captioner.ui") for m in ours), ours


def test_what_decoding_reads_is_held_not_hidden():
    """State you can see (decoding/resources.py): no module writes an entry of an object's __dict__ (the fitted
    data and the consensus memory once hid on the torch module so), and decoding keeps no process-wide registry
    keyed by module (the CUDA-graph recordings once did): its owner, the Captioner, holds them and passes them."""
    hidden = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "__dict__":
                hidden.append(f"{p.relative_to(PACKAGE)}:{node.lineno} __dict__[...]")
            if p.parent.name == "decoding" and isinstance(node, (ast.Name, ast.Attribute)) \
                    and getattr(node, "id", getattr(node, "attr", "")) in ("WeakIdKeyDictionary", "WeakKeyDictionary"):
                hidden.append(f"{p.relative_to(PACKAGE)}:{node.lineno} a registry keyed by object")
    assert not hidden, hidden
