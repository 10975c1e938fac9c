"""Docs that cannot drift: every project file the docs name exists.

Scanned: README.md and docs/*.md (every line, code blocks included; captioner/assets/examples/CREDITS.md
names scikit-image's files, not ours), and the docstrings, other bare string statements and comments of
every .py file under captioner/, scripts/ and tests/ plus app.py (string literals in code are data, not
prose: they are not scanned).

A name is a path ending in .py .yaml .yml .md .safetensors .jpg .png. It exists when it is a file
relative to the repository root or to the file that names it, or when it is the tail of a project file's
path (`search.py`, `concepts/maps.py`, `cli/train.py`). A folder named from the repository root
(`captioner/evaluation/`) must exist too, and every relative Markdown link must resolve from its page.

Not project files, hence never checked: URLs and absolute paths, globs (`*`), templates (`<stem>_x.png`),
paths under ../ (the shared data), runs/, cache/ and overlays/ (what commands write), and the short
commented allow-lists below.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_DIRS = ("captioner", "configs", "docs", "scripts", "tests")

# a path token: not the middle of a longer path, word, URL, glob or <template>
_BEFORE = r"(?<![\w./*<>{}$~:-])"
FILE = re.compile(_BEFORE + r"((?:[\w.-]+/)*[\w*-]+\.(?:py|yaml|yml|md|safetensors|jpg|png))(?![\w/*-])")
FOLDER = re.compile(_BEFORE + r"((?:%s)/(?:[\w-]+/)*)(?![\w.*<{-])" % "|".join(PROJECT_DIRS))
LINK = re.compile(r"\]\(([^)\s]+)\)")

# what commands write or read outside the repository
NOT_PROJECT_PREFIXES = ("../", "runs/", "cache/", "overlays/")

# user-side names: files the reader has or makes, never files of this repository
USER_SIDE = frozenset({
    # the reader's own photos in usage examples (README.md, scripts/caption.py)
    "photo.jpg", "other.png",
    # what a training run or an export writes, named without its folder (train.out_dir, export target)
    "best.safetensors", "last.safetensors", "out_dir/last.safetensors", "model.safetensors", "training.png",
    # names the reader picks in a recipe (docs/training.md, docs/scst.md)
    "coco_smoke.safetensors", "xe.safetensors",
    # example names explaining a naming rule (captioner/cli/caption.py, captioner/data/flickr8k.py,
    # the figure-folder test of tests/test_scripts.py)
    "x.jpg", "x.png", "name.jpg", "photos/a/x.jpg", "a/x.png", "b/x.jpg", "x_attention.png", "_attention.png",
    # the reader's own photo folder (README.md "Train on your own photos")
    "myphotos/Images/beach_01.jpg", "myphotos/Images/beach_02.jpg",
})
# Flickr8k photos named by id (docs/results.md's examples): they live in the data set, not here
DATASET_PHOTO = re.compile(r"\d+_[0-9a-f]{10}\.jpg")
# (page, name) pairs that name something removed, on purpose, as history
RETIRED = frozenset({
    ("docs/hallucination.md", "captioner/lm/"),  # "Language for what Flickr8k never says: retired"
})


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_files() -> list[Path]:
    found = [ROOT / "app.py"]
    for d in ("captioner", "scripts", "tests"):
        found += sorted(p for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)
    return found


def _python_prose(src: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every bare string statement (docstrings included)."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(node.lineno + j, line) for j, line in enumerate(node.value.value.splitlines())]
    return out


def prose() -> list[tuple[str, int, str]]:
    """(file relative to the root, line, text) for everything the test reads."""
    out = []
    for p in _markdown_files():
        rel = p.relative_to(ROOT).as_posix()
        out += [(rel, i, line) for i, line in enumerate(p.read_text().splitlines(), 1)]
    for p in _python_files():
        rel = p.relative_to(ROOT).as_posix()
        out += [(rel, i, line) for i, line in _python_prose(p.read_text())]
    return out


def project_files() -> set[str]:
    files = {p.name for p in ROOT.iterdir() if p.is_file()}
    for d in PROJECT_DIRS:
        files |= {p.relative_to(ROOT).as_posix() for p in (ROOT / d).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts}
    return files


def _file_exists(name: str, where: str, files: set[str]) -> bool:
    if (ROOT / name).is_file() or (ROOT / where).parent.joinpath(name).is_file():
        return True
    return any(f == name or f.endswith("/" + name) for f in files)


def _checked(name: str) -> bool:
    return not ("*" in name or name.startswith(NOT_PROJECT_PREFIXES) or name in USER_SIDE
                or DATASET_PHOTO.fullmatch(name))


def missing_names(lines: list[tuple[str, int, str]], files: set[str]) -> list[str]:
    """'name (file:line)' for every project file or folder named in `lines` that does not exist."""
    missing = []
    for where, i, text in lines:
        for m in FILE.finditer(text):
            name = m.group(1).removeprefix("./")
            if _checked(name) and not _file_exists(name, where, files):
                missing.append(f"{name} ({where}:{i})")
        for m in FOLDER.finditer(text):
            if (where, m.group(1)) not in RETIRED and not (ROOT / m.group(1)).is_dir():
                missing.append(f"{m.group(1)} ({where}:{i})")
    return missing


def test_every_named_project_file_exists():
    lines = prose()
    missing = missing_names(lines, project_files())
    assert not missing, ("names of files that do not exist (point them at the file that now holds the thing, "
                         "or reword; user-side names go in USER_SIDE):\n  " + "\n  ".join(missing))


def test_markdown_links_resolve():
    broken = []
    for p in _markdown_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1).split("#")[0]
                if target and not re.match(r"[a-z]+:", target) and not (p.parent / target).exists():
                    broken.append(f"{m.group(1)} ({p.relative_to(ROOT).as_posix()}:{i})")
    assert not broken, "Markdown links that resolve to nothing:\n  " + "\n  ".join(broken)


def test_the_scan_reads_the_docs_and_catches_stale_names():
    """The scan is not vacuous (it sees names that exist) and it fails on names that do not, while
    leaving URLs, globs, user-side names and paths outside the repository alone."""
    lines = prose()
    seen = {m.group(1) for _, _, text in lines for m in FILE.finditer(text)}
    assert {"scripts/train.py", "configs/flickr8k_cpu.yaml", "concepts/maps.py", "docs/results.md"} <= seen
    assert {"docs/hallucination.md", "captioner/__init__.py", "app.py"} <= {w for w, _, _ in lines}
    stale = [("docs/x.md", 3, "see `captioner/lm/fusion.py`, concept_maps.py and [notes](notes.md) in captioner/lm/"),
             ("captioner/x.py", 7, "# grounding/words.py: the table; configs/gone.yaml")]
    fine = [("docs/x.md", 1, "python scripts/caption.py photo.jpg --checkpoint runs/a/best.safetensors "
                             "https://example.org/a/b.py captioner/assets/examples/*.jpg /tmp/x.png "
                             "../shared/data/coco/x.jpg out/<stem>_attention.png search.py concepts/maps.py")]
    got = missing_names(stale + fine, project_files())
    assert got == ["captioner/lm/fusion.py (docs/x.md:3)", "concept_maps.py (docs/x.md:3)",
                   "notes.md (docs/x.md:3)", "captioner/lm/ (docs/x.md:3)",
                   "grounding/words.py (captioner/x.py:7)", "configs/gone.yaml (captioner/x.py:7)"], got
