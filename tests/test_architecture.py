"""The package stays readable: small modules, short functions, no monkeypatching at import time."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "captioner"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 300, 60


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_modules_are_small():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


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
