"""Guards for the repository layout and the layering rules of DESIGN.md §1."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("common", "engine", "connectors", "kernels", "router", "operator")
ALL_FOLDERS = CODE_FOLDERS + ("crds", "charts", "examples", "tests", "e2e", "bench", "docs")
# folder -> epdserve sub-packages it may import (besides itself)
# the stdlib module, fetched by name: this file must itself pass the bare-import check
STDLIB_OPERATOR = importlib.import_module("operator")
ALLOWED_INTERNAL = {
    "common": set(),  # the bottom package: logging, /metrics parsing, chat parts
    "operator": {"common"},
    "router": {"connectors", "common"},
    "engine": {"connectors", "kernels", "common"},
    "connectors": {"common"},
    "kernels": {"common"},
}
NO_TORCH = ("common", "operator", "router")
HEAVY = {"torch", "transformers", "triton"}
MAX_LINES = 300  # a file that grows past this is two ideas (STYLE.md)
LINE_LIMITED = CODE_FOLDERS + ("tests", "e2e", "bench")
NOT_OURS = {".venv", "build", "__pycache__"}


def python_files(folder: str):
    return [p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]


def imported_modules(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.module, alias.name


def test_every_folder_of_the_layout_exists():
    missing = [f for f in ALL_FOLDERS if not (ROOT / f).is_dir()]
    assert not missing, f"missing top-level folders: {missing}"


@pytest.mark.parametrize("folder", CODE_FOLDERS)
def test_mapped_folder_has_no_root_init(folder):
    assert not (ROOT / folder / "__init__.py").exists(), (
        f"{folder}/__init__.py must not exist: the folder is mapped to epdserve.{folder} "
        "and a root __init__ would let it shadow another module"
    )


def test_no_code_imports_a_folder_bare():
    offenders = []
    for folder in ALL_FOLDERS:
        for path in python_files(folder):
            for module, name in imported_modules(path):
                top, _, rest = module.partition(".")
                if top in ("common", "engine", "connectors", "kernels", "router"):
                    offenders.append(f"{path.relative_to(ROOT)}: import {module}")
                elif top == "operator" and (rest or (name and not hasattr(STDLIB_OPERATOR, name))):
                    offenders.append(f"{path.relative_to(ROOT)}: import {module} {name or ''}")
    assert not offenders, "bare imports of project folders:\n" + "\n".join(offenders)


def test_no_python_file_is_over_300_lines():
    paths = [*ROOT.glob("*.py"), *(p for f in LINE_LIMITED for p in (ROOT / f).rglob("*.py"))]
    paths = [p for p in paths if not NOT_OURS & set(p.relative_to(ROOT).parts)]
    assert Path(__file__).resolve() in paths  # the walk sees the repository's files
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in paths}
    over = sorted((n, path) for path, n in lines.items() if n > MAX_LINES)
    assert not over, f"files over {MAX_LINES} lines (split each along an idea):\n" + "\n".join(
        f"{path}: {n} lines" for n, path in reversed(over)
    )


@pytest.mark.parametrize("folder", CODE_FOLDERS)
def test_layering_rules_hold(folder):
    offenders = []
    for path in python_files(folder):
        for module, _ in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "epdserve" and len(parts) > 1 and parts[1] in CODE_FOLDERS:
                if parts[1] != folder and parts[1] not in ALLOWED_INTERNAL[folder]:
                    offenders.append(f"{path.relative_to(ROOT)} imports {module}")
            if folder in NO_TORCH and parts[0] in HEAVY:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, f"layering broken in {folder}/:\n" + "\n".join(offenders)


def test_router_and_operator_modules_import_without_torch():
    modules = []
    for folder in NO_TORCH:
        for path in python_files(folder):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            modules.append(".".join(("epdserve", folder, *rel.parts)))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy[:5]\n"
        "import epdserve.engine.cli\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_stdlib_operator_is_not_shadowed_from_the_repo_root():
    code = "import operator; assert hasattr(operator, 'itemgetter'), operator.__file__"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


# optional packages libraries probe for by name (transformers: the hub `kernels`), installed or not
PROBED_OPTIONAL = {"kernels", "flash_attn", "triton", "xgrammar", "outlines", "peft", "vllm"}


def test_no_bench_script_shadows_a_package():
    # the bench tests put bench/ on sys.path; a script named like a package (bench/kernels.py) then
    # answered transformers' probe for the `kernels` package, and every model import failed
    code = (
        "import importlib.metadata as md, json, sys\n"
        "tops = {n for d in md.distributions() for n in (d.read_text('top_level.txt') or '').split()}\n"
        "print(json.dumps(sorted(tops | set(sys.stdlib_module_names))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    )
    taken = set(__import__("json").loads(out.stdout)) | PROBED_OPTIONAL
    stems = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert not stems & taken, sorted(stems & taken)


def test_wheel_ships_every_code_file_and_nothing_from_the_root(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    import zipfile

    (wheel,) = tmp_path.glob("epdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"epdserve/{p.relative_to(ROOT).as_posix()}"
        for folder in CODE_FOLDERS
        for p in python_files(folder)
    }
    assert expected <= names, sorted(expected - names)[:10]
    assert "epdserve/__init__.py" in names
    assert "epdserve/kernels/csrc/paged_decode.c" in names  # built at run time
    assert "epdserve/setup.py" not in names


@pytest.mark.parametrize("folder", ["common", "operator", "router", "connectors"])
def test_every_module_imports_first_on_its_own(folder):
    """No import cycle hides behind a lucky import order: each module, imported before any
    other of its folder, loads."""
    modules = [
        ".".join(("epdserve", folder, *p.relative_to(ROOT / folder).with_suffix("").parts))
        for p in python_files(folder)
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        f"    for k in [k for k in sys.modules if k.startswith('epdserve.{folder}')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module(m)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
