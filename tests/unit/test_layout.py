"""The layout: one import name whose every path is on disk, no bare top-level imports, one command whose
subcommands answer --help."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from rollout_bus.cli import COMMANDS, resolve

ROOT = Path(__file__).resolve().parents[2]
# The top-level package folders: every folder of the checkout with an __init__.py, the tests aside.
FOLDERS = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"rollout_bus", "tests"}


def python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in listed if (ROOT / f).is_file()]


def test_no_module_imports_a_folder_by_its_bare_name() -> None:
    """``import events`` works from a checkout but not installed: every import goes through rollout_bus."""
    bare: list[str] = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            bare += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert bare == []


def git_modes(*paths: str) -> dict[str, str]:
    listed = subprocess.run(["git", "ls-files", "--stage", "--", *paths], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    return {line.split("\t", 1)[1]: line.split()[0] for line in listed}


def test_every_package_folder_is_linked_into_rollout_bus_and_checked_in() -> None:
    """A top-level package folder is ``rollout_bus.<name>`` through a link ``rollout_bus/<name> -> ../<name>``
    that git holds, so the import path is a path on disk for every tool, installed or not."""
    assert {"events", "controller", "executor", "trainer", "gateway"} <= FOLDERS
    modes = git_modes("rollout_bus")
    for name in sorted(FOLDERS):
        link = ROOT / "rollout_bus" / name
        assert link.is_symlink(), f"{name}/ is a package folder but rollout_bus/{name} is no link to it"
        assert os.readlink(link) == f"../{name}", f"rollout_bus/{name} must be the relative link ../{name}"
        assert modes.get(f"rollout_bus/{name}") == "120000", f"git does not hold the link rollout_bus/{name}"
        spec = importlib.util.find_spec(f"rollout_bus.{name}")
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).resolve() == ROOT / name / "__init__.py"
    links = {p.name for p in (ROOT / "rollout_bus").iterdir() if p.is_symlink()}
    assert links == FOLDERS, f"links without a package folder: {sorted(links - FOLDERS)}"
    assert not (ROOT / "scripts" / "__init__.py").exists()


def test_no_install_time_map_rebuilds_the_package() -> None:
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools
    assert setuptools["packages"] == {"find": {"include": ["rollout_bus", "rollout_bus.*"]}}


def test_jedi_goes_from_a_role_to_the_bus_module_that_defines_the_name() -> None:
    """An editor's go-to-definition (jedi) on ``Keys`` in controller/service.py lands in events/names.py."""
    jedi = pytest.importorskip("jedi")
    path = ROOT / "controller" / "service.py"
    lines = path.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith("from rollout_bus.events.names import"))
    column = lines[line - 1].index("Keys")
    found = jedi.Script(path.read_text(), path=path, project=jedi.Project(ROOT)).goto(line, column,
                                                                                       follow_imports=True)
    assert [(Path(str(d.module_path)).resolve(), d.name) for d in found] == [(ROOT / "events" / "names.py", "Keys")]
    assert found[0].type == "class"


@pytest.mark.integration
def test_the_wheel_installs_one_top_level_import_name_that_imports_every_role(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the wheel and nothing beside it
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300, env=clean)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("rollout_bus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"rollout_bus"}
    for folder in FOLDERS:
        for source in (ROOT / folder).rglob("*.py"):
            inside = f"rollout_bus/{source.relative_to(ROOT).as_posix()}"
            assert inside in names, f"{source.relative_to(ROOT)} is missing from the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "rollout-bus = rollout_bus.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # A fresh venv with the wheel alone; the dependencies come from this interpreter's site-packages,
    # added after the venv's own (a path added by a .pth file runs none of its .pth files, so this
    # checkout's editable finder stays out).
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    Path(site, "deps.pth").write_text(ours + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                                str(wheel)], capture_output=True, text=True, timeout=300, env=clean)
    assert installed.returncode == 0, installed.stderr
    probe = ("import importlib, sys\n"
             "import rollout_bus\n"
             f"for name in {sorted(FOLDERS)!r} + ['cli', 'status', 'request']:\n"
             "    module = importlib.import_module('rollout_bus.' + name)\n"
             f"    assert module.__file__.startswith({site!r}), module.__file__\n"
             "for bare in ('events', 'controller'):\n"
             "    try:\n        importlib.import_module(bare)\n    except ModuleNotFoundError:\n        pass\n"
             "    else:\n        sys.exit(f'{bare} importable on its own')\n"
             "print('OK')\n")
    ran = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=clean)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "OK"


def test_the_command_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_bus.cli import main

    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS)
    with pytest.raises(SystemExit, match="unknown command 'contoller'.*did you mean controller"):
        main(["contoller"])


def test_aliases_reach_the_command_that_owns_them() -> None:
    command, rest = resolve(["trainer", "offline", "--log", "x"])
    assert command.module == "rollout_bus.replay.cli" and rest == ["offline", "--log", "x"]
    command, rest = resolve(["record", "--out", "d"])
    assert command.module == "rollout_bus.trainer.cli" and rest == ["record", "--out", "d"]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_answers_help_without_loading_torch_or_a_redis_client(name: str) -> None:
    probe = ("import sys\nfrom rollout_bus.cli import main\n"
             f"try:\n    main([{name!r}, '--help'])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
             "heavy = sorted(m for m in ('torch', 'redis', 'rq', 'aiohttp') if m in sys.modules)\n"
             "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "usage: rollout-bus" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []"
