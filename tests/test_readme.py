"""README's commands run as written after its set-up: every command line of its bash blocks names an
installed entry point of this project (or the venv's python/pip/streamlit), and every --flag it passes is
one that command accepts (its --help lists it)."""
from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from .conftest import ROOT

README = (ROOT / "README.md").read_text()
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
VENV_TOOLS = {"python", "pip", "streamlit"}


def _command_lines() -> list[str]:
    """Each command line of README's ```bash blocks, comments and the set-up/test one-liners left out."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith(("#", "(command -v", "python3 -m venv")):
                lines.append(line)
    return lines


def test_readme_has_command_lines():
    assert len(_command_lines()) >= 10  # the parse found the blocks: this test can fail


@functools.cache  # one process per entry point, however many README lines use it
def _help(name: str) -> str:
    """What `name --help` prints, run in a fresh process as the installed entry point runs it."""
    module, func = SCRIPTS[name].split(":")
    return subprocess.run([sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}(['--help']))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.parametrize("line", _command_lines())
def test_each_readme_command_names_an_installed_program_and_known_flags(line):
    words = shlex.split(line)
    assert words[0].startswith(".venv/bin/"), f"'{line}': after the set-up, commands run from .venv/bin/"
    name = words[0].removeprefix(".venv/bin/")
    assert name in SCRIPTS or name in VENV_TOOLS, f"'{line}': {name} is not an entry point of pyproject.toml"
    if name not in SCRIPTS:
        return
    help_text = _help(name)
    assert "usage:" in help_text, f"{name} --help printed no usage"
    for flag in (w.split("=")[0] for w in words[1:] if w.startswith("--")):
        assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", help_text), f"'{line}': {name} has no option {flag}"


def test_the_set_up_installs_every_entry_point_readme_uses():
    venv = ROOT / ".venv" / "bin"
    if not venv.is_dir():
        pytest.skip("no .venv here (the README's set-up was not run in this checkout)")
    used = {shlex.split(line)[0].removeprefix(".venv/bin/") for line in _command_lines()}
    missing = sorted(n for n in used if not (venv / n).exists())
    assert not missing, f"README uses {missing}, which `pip install -e .` did not install into .venv/bin"


# scripts that are tools of this repository, not commands a user installs (README, "Command line", names them)
SCRIPT_ONLY = {"gpu_check.py", "make_new_word_folder.py"}


def test_every_console_command_is_a_script_of_the_same_name_and_back():
    """captioner-<x> (pyproject.toml) and scripts/<x>.py (dashes as underscores) run the same main, one to one."""
    wrappers = {p.name: p.read_text() for p in (ROOT / "scripts").glob("*.py") if p.name not in SCRIPT_ONLY}
    expected = {name.removeprefix("captioner-").replace("-", "_") + ".py": target for name, target in SCRIPTS.items()}
    assert sorted(wrappers) == sorted(expected), "scripts/*.py and pyproject.toml's [project.scripts] differ"
    for script, target in expected.items():
        module, func = target.split(":")
        assert f"from {module} import {func}" in wrappers[script], f"scripts/{script} does not run {target}"
    assert all((ROOT / "scripts" / s).is_file() for s in SCRIPT_ONLY)  # the allow-list names real scripts


def test_the_set_up_is_two_visible_commands_and_the_cpu_install_its_own():
    """The set-up's first block: the install and the app's start, one line each (not one chained line); the
    CPU-only install is a block of its own a reader can copy, not a command inside prose."""
    setup = README.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = [b.strip().splitlines() for b in re.findall(r"```bash\n(.*?)```", setup, re.S)]
    assert blocks[0] == ["python3 -m venv .venv && .venv/bin/pip install -e .", ".venv/bin/streamlit run app.py"]
    cpu = [b for b in blocks if any("download.pytorch.org/whl/cpu" in line for line in b)]
    assert len(cpu) == 1 and len(cpu[0]) == 1 and cpu[0][0].endswith(".venv/bin/pip install -e .")
    prose = re.sub(r"```.*?```", "", setup, flags=re.S)
    assert "whl/cpu" not in prose
