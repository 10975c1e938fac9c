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
import functools
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
    "coco_smoke.safetensors", "xe.safetensors", "coco.safetensors",
    # what train.keep_epochs writes (captioner/config.py, docs/training.md) and the COCO layout docs/training.md shows
    "epoch_E.safetensors", "data/coco/train2014/COCO_train2014_000000000009.jpg",
    "data/coco/val2014/COCO_val2014_000000000042.jpg",
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


@functools.cache  # read once for the module's tests (they only read it)
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


# ----------------------------------------------------------------------------- code names in docs/*.md
# A backticked dotted name (`decoding.search.decode`, `Captioner.read(image)`, `decode.beam_size`) or a backticked
# call with empty parentheses (`caption()`) names code, and that code must exist. A dotted name is checked when its
# first part is a module or package (any tail of its path: `search`, `decoding.search`), a class of the project
# or a config section (`decode.*`); each further part must be defined THERE (a module's own definitions, not what
# it imports; a package's names; a class's methods, fields and attributes, its project bases' too). Once a part
# is a function or an attribute the rest is not followed (`Captioner.config.decode`). Other first parts are
# instances in examples (`cap.text`, `torch.compile`): not checked.

FILE_EXTENSIONS = frozenset({"py", "yaml", "yml", "md", "json", "jsonl", "txt", "png", "jpg", "safetensors", "html"})
CODE_NAME = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Za-z_]\w*(?=\(\)))[^`]*`")


class _Module:
    def __init__(self, path: Path, tree: ast.Module, package: bool):
        self.path, self.package = path, package
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.names: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    self.names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif package and isinstance(node, (ast.Import, ast.ImportFrom)):  # a package hands names on
                self.names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif package and isinstance(node, ast.If):  # ... or on first use (PEP 562), declared under TYPE_CHECKING
                self.names |= {(a.asname or a.name).split(".")[0] for sub in node.body
                               if isinstance(sub, (ast.Import, ast.ImportFrom)) for a in sub.names}
        self.submodules: dict[str, "_Module"] = {}


def _class_members(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
    return out


@functools.cache
def code_index() -> tuple[dict[str, list[_Module]], dict[str, list[ast.ClassDef]], set[str]]:
    """(dotted path tail -> modules, class name -> class definitions, every def and class name)."""
    modules: dict[str, list[_Module]] = {}
    by_parts: dict[tuple[str, ...], _Module] = {}
    classes: dict[str, list[ast.ClassDef]] = {}
    defined: set[str] = set()
    for p in [ROOT / "app.py", *sorted((ROOT / "captioner").rglob("*.py"))]:
        if "__pycache__" in p.parts:
            continue
        tree = ast.parse(p.read_text())
        parts = p.relative_to(ROOT).with_suffix("").parts
        package = parts[-1] == "__init__"
        parts = parts[:-1] if package else parts
        mod = _Module(p, tree, package)
        by_parts[parts] = mod
        for i in range(len(parts)):
            modules.setdefault(".".join(parts[i:]), []).append(mod)
        for name, defs in mod.classes.items():
            classes.setdefault(name, []).extend(defs)
        defined |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for parts, mod in by_parts.items():  # a package's submodules are its names too
        if len(parts) > 1 and parts[:-1] in by_parts:
            by_parts[parts[:-1]].submodules[parts[-1]] = mod
    return modules, classes, defined


def _config_sections() -> dict[str, set[str]]:
    import dataclasses as dc

    from captioner.config import Config

    cfg = Config()
    return {f.name: {g.name for g in dc.fields(getattr(cfg, f.name))} | set(vars(type(getattr(cfg, f.name))))
            for f in dc.fields(Config) if dc.is_dataclass(getattr(cfg, f.name))}


def code_name_exists(name: str, index, sections: dict[str, set[str]]) -> bool | None:
    """True / False for a checked name, None when its first part is not the project's (not checked)."""
    modules, classes, defined = index
    parts = name.split(".")
    if parts[-1] in FILE_EXTENSIONS:  # a file name (test_every_named_project_file_exists checks those)
        return None
    if len(parts) == 1:
        return name in defined

    def in_class(defs: list[ast.ClassDef], rest: list[str]) -> bool:
        if not rest:
            return True
        for cls in defs:
            members = _class_members(cls)
            for base in cls.bases:  # the project's base classes
                if isinstance(base, ast.Name) and base.id in classes:
                    members |= set().union(*(_class_members(b) for b in classes[base.id]))
            if rest[0] in members:
                nested = [n for n in cls.body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
                return in_class(nested, rest[1:]) if nested else True
        return False

    def in_module(mod: _Module, rest: list[str]) -> bool:
        if not rest:
            return True
        if rest[0] in mod.submodules:
            return in_module(mod.submodules[rest[0]], rest[1:])
        if rest[0] in mod.classes:
            return in_class(mod.classes[rest[0]], rest[1:])
        return rest[0] in mod.names

    known = any(".".join(parts[:i]) in modules for i in range(1, len(parts) + 1))
    known = known or parts[0] in classes or parts[0] in sections
    if not known:
        return None
    for i in range(len(parts), 0, -1):
        if any(in_module(m, parts[i:]) for m in modules.get(".".join(parts[:i]), [])):
            return True
    if parts[0] in classes and in_class(classes[parts[0]], parts[1:]):
        return True
    return parts[0] in sections and parts[1] in sections[parts[0]]


def missing_code_names(lines: list[tuple[str, int, str]]) -> list[str]:
    """'name (file:line)' for every code name in `lines` (backticked, see CODE_NAME) that does not exist."""
    index, sections = code_index(), _config_sections()
    return [f"{m.group(1)} ({where}:{i})" for where, i, text in lines for m in CODE_NAME.finditer(text)
            if code_name_exists(m.group(1), index, sections) is False]


def _docs_lines() -> list[tuple[str, int, str]]:
    return [(p.relative_to(ROOT).as_posix(), i, line) for p in sorted((ROOT / "docs").glob("*.md"))
            for i, line in enumerate(p.read_text().splitlines(), 1)]


def test_every_code_name_in_the_docs_exists():
    missing = missing_code_names(_docs_lines())
    assert not missing, ("code names in docs/*.md that the code does not define (name the module that now "
                         "holds the thing, or reword):\n  " + "\n  ".join(missing))


def test_the_code_name_scan_is_not_vacuous_and_catches_stale_names():
    lines = [("docs/x.md", 1, "`decoding.search.decode`, `rules.unruled`, `Captioner.read(image) -> Photo`, "
                              "`decode.beam_size`, `caption()`, `captioner.load().metrics`, `Caption.to_dict()`"),
             ("docs/x.md", 2, "`cap.text`, `torch.compile`, `photo.jpg`, `head(mean_i a_i)` are not the project's"),
             ("docs/x.md", 3, "`search.word_logp` (imported there, defined in rules.py), `Captioner.features(image)`, "
                              "`decode.beam_sise`, `get_features()`, `imagenet.detect`")]
    assert missing_code_names(lines) == ["search.word_logp (docs/x.md:3)", "Captioner.features (docs/x.md:3)",
                                         "decode.beam_sise (docs/x.md:3)", "get_features (docs/x.md:3)",
                                         "imagenet.detect (docs/x.md:3)"]


# ----------------------------------------------------------------------------- code names in the package's prose
# The package's docstrings and comments (captioner/, scripts/, app.py) follow the docs' rule for dotted names and
# calls (CODE_NAME). A backticked single snake_case or CamelCase name (`captions_from_features`, `ruled_out`,
# `Interrupted`) names a function, class, argument, attribute or key: it must occur in the project's code (an
# identifier, or a string key such as a JSON field). Plain backticked words (`steps`, `finally`) are prose.
SINGLE_NAME = re.compile(r"`([A-Za-z_]\w*)`")
_SPELLED = {ast.Name: "id", ast.Attribute: "attr", ast.arg: "arg", ast.keyword: "arg"}  # node -> its name field


@functools.cache
def _package_prose() -> list[tuple[str, int, str]]:
    files = [ROOT / "app.py", *sorted((ROOT / "captioner").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.py"))]
    return [(p.relative_to(ROOT).as_posix(), i, line) for p in files if "__pycache__" not in p.parts
            for i, line in _python_prose(p.read_text())]


@functools.cache
def code_identifiers() -> set[str]:
    """Every name the project's code spells: definitions, arguments, names, attributes, keywords, imports and
    identifier-like string constants (dict keys, getattr names, JSON fields)."""
    found: set[str] = set()
    for p in [ROOT / "app.py", *(ROOT / "captioner").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(n.name)
            elif type(n) in _SPELLED:
                found.add(getattr(n, _SPELLED[type(n)]) or "")  # a **kwargs keyword has no name
            elif isinstance(n, ast.alias):
                found.add((n.asname or n.name).split(".")[-1])
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
                found.add(n.value)
    return found


def missing_single_names(lines: list[tuple[str, int, str]], identifiers: set[str]) -> list[str]:
    """'name (file:line)' for every backticked snake_case or CamelCase name the code never spells."""
    return [f"{m.group(1)} ({where}:{i})" for where, i, text in lines for m in SINGLE_NAME.finditer(text)
            if ("_" in m.group(1).strip("_") or m.group(1)[0].isupper()) and m.group(1) not in identifiers]


def test_every_code_name_in_the_package_prose_exists():
    lines = _package_prose()
    missing = missing_code_names(lines) + missing_single_names(lines, code_identifiers())
    assert not missing, ("code names in the package's docstrings and comments that the code does not define "
                         "(name what now holds the thing, or reword):\n  " + "\n  ".join(missing))


def test_the_package_prose_scan_is_not_vacuous_and_catches_stale_names():
    lines = _package_prose()
    assert {"app.py", "captioner/api.py", "scripts/train.py"} <= {w for w, _, _ in lines}
    assert sum(bool(CODE_NAME.search(t)) for _, _, t in lines) > 20  # the package's prose does name code
    ids = code_identifiers()
    assert {"captions_from_features", "ruled_out", "Interrupted", "beam_size"} <= ids
    stale = [("captioner/x.py", 4, "# `captions_from_photos` (renamed), `ruled_outs`, `Interupted`; `steps` and "
                                   "`finally` are words, `__init__` and `ruled_out` exist")]
    assert missing_single_names(stale, ids) == ["captions_from_photos (captioner/x.py:4)",
                                                "ruled_outs (captioner/x.py:4)", "Interupted (captioner/x.py:4)"]


# ----------------------------------------------------------------------------- no measured timings in code
# A measured figure is one machine's fact: docs/performance.md keeps it, with where it was measured ("Measured
# once, kept out of the code"); the package's docstrings and comments keep the reason, not the number. A duration
# ("85 ms", "13.2 s", "about 10 minutes") or a speed ratio ("1.4x faster", "40% slower") is a measured timing;
# shapes (4H), factors (2x finer) and settings named without a number are not.
TIMING = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s*(?:ms|µs|s|sec|seconds?|min|minutes?|hours?)\b(?!\()"
                    r"|(?<![\w.])\d+(?:\.\d+)?\s*(?:x|%|times)\s+(?:faster|slower|as long)\b")


def test_no_measured_timings_in_the_package_prose():
    found = [f"{where}:{i}: {text.strip()}" for where, i, text in _package_prose() if TIMING.search(text)]
    assert not found, ("measured timings in docstrings or comments (move the figure to docs/performance.md, "
                       "keep the reason):\n  " + "\n  ".join(found))


def test_the_timing_scan_catches_timings_and_leaves_shapes_alone():
    timings = ["85 -> 79 ms on 1 thread", "took 13.2 s, now 6.5 s", "about 2-3 minutes in all", "~1.4x faster",
               "measured 25-40% faster", "cost 18x as long", "10 min on one CPU"]
    fine = ["(B*G, 4H): eq. 1", "a 2x finer native grid", "between 1x and 2x max_side", "train.max_seconds",
            "5 steps at lr 1e-3", "beam 5, 100 photos", "(N, P, A) x (A,)"]
    assert [bool(TIMING.search(s)) for s in timings + fine] == [True] * len(timings) + [False] * len(fine)


def test_the_readme_stays_short():
    """README is the front door (set-up, first use, results, where to read on); studies live in docs/. Its bar:
    12 KB (it had grown to 16.5 KB)."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12_000, f"README.md is {size:,} bytes: move a study or a long section to docs/"


# ----------------------------------------------------------------------------- tests named as proof
# `tests/test_<file>.py::test_<name>` (or without tests/, then `::test_<other>` of the same file) in the docs or
# the package's prose names the test that proves a claim (the decoding-paths table): that test must exist.
TEST_REF = re.compile(r"(?:(test_\w+\.py))?::(test_\w+)")


def test_every_named_test_exists():
    missing, tests = [], {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
    for where, i, text in prose():
        last = None
        for m in TEST_REF.finditer(text):
            last = m.group(1) or last
            if last is None or f"def {m.group(2)}(" not in tests.get(last, ""):
                missing.append(f"{last}::{m.group(2)} ({where}:{i})")
    assert not missing, "tests named as proof that do not exist:\n  " + "\n  ".join(missing)


# ----------------------------------------------------------------------------- every module named
def _modules_named_in_architecture() -> tuple[set[str], set[str]]:
    """(the modules, the folders) docs/architecture.md's "Module by module" block names. A module is named by the
    file names that open an entry line, in the root's part (under `captioner/`) or in a folder's part (`  model/`
    and the lines below it); a folder's own line stands for its __init__.py (the folder's face)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("## Module by module", 1)[1].split("```", 2)[1]
    named, folders, folder = set(), set(), None
    for line in block.splitlines():
        if re.match(r"^\S", line):  # a top-level entry: the package, or scripts/, app.py, configs/ ...
            folder = "" if line.startswith("captioner/") else None
        elif folder is not None and (m := re.match(r"^  (\w+)/", line)):
            folder = m.group(1) + "/"
            folders.add(folder)
        elif folder is not None and (m := re.match(r"^ {2,4}((?:\w+\.py\s+)+)", line)):
            named |= {folder + name for name in m.group(1).split()}
    return named, folders


def test_architecture_names_every_module_of_the_package():
    """Completeness, not only existence: every captioner/**/*.py is named in its folder's part of the module list,
    and every module named there exists."""
    modules = {p.relative_to(ROOT / "captioner").as_posix() for p in (ROOT / "captioner").rglob("*.py")}
    named, folders = _modules_named_in_architecture()
    assert len(named) > 50 and "bench/" in folders  # the parse found the list: this test can fail
    missing = {m for m in modules - named if not (m.endswith("__init__.py") and m[:-len("__init__.py")] in folders)}
    assert not missing, f"docs/architecture.md's module list does not name: {sorted(missing)}"
    assert not named - modules, f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
