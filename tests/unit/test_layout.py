"""The layout: one import name, no bare top-level imports, one command whose subcommands answer --help."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from rollout_bus.cli import COMMANDS, resolve

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = {folder for name, folder in PACKAGE_DIR.items() if name != "rollout_bus"}


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


def test_each_mapped_folder_is_a_package_and_nothing_else_is_one() -> None:
    for folder in FOLDERS | {"rollout_bus"}:
        assert (ROOT / folder / "__init__.py").is_file(), folder
    assert not (ROOT / "scripts" / "__init__.py").exists()


@pytest.mark.integration
def test_the_wheel_installs_one_top_level_import_name(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("rollout_bus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"rollout_bus"}
    for name, folder in PACKAGE_DIR.items():
        inside = "/".join(name.split("."))
        for source in (ROOT / folder).glob("*.py"):
            assert f"{inside}/{source.name}" in names, f"{folder}/{source.name} is missing from the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "rollout-bus = rollout_bus.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


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
