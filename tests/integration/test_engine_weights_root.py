"""An engine started with ``--weights-root`` loads weights and adapters over HTTP only from inside it (or the
model it started with): a real engine process, real HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_proc import EngineProcess, make_weights_dir

pytestmark = pytest.mark.integration


def version(engine: EngineProcess) -> str:
    return str(engine.get("/model_info")[1]["weight_version"])


def test_weights_and_adapters_from_outside_the_weights_root_are_refused(tmp_path: Path) -> None:
    model = make_weights_dir(tmp_path / "model")
    root = tmp_path / "root"
    inside = make_weights_dir(root / "p" / "v000001", seed=1)
    elsewhere = make_weights_dir(tmp_path / "elsewhere", seed=2)
    (root / "link").symlink_to(elsewhere, target_is_directory=True)
    with EngineProcess(model, weight_version="0", extra_args=["--weights-root", str(root), "--enable-lora"]) as engine:
        for path in (elsewhere, root / "link", root / ".." / "elsewhere", Path("/etc")):
            status, reply = engine.post("/update_weights_from_disk", {"model_path": str(path), "weight_version": "9"})
            assert status == 400 and "outside this engine's --weights-root" in reply["message"], reply
            status, reply = engine.post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(path)})
            assert status == 400 and "outside this engine's --weights-root" in reply["error_message"], reply
        assert version(engine) == "0"  # nothing was loaded
        status, reply = engine.post("/update_weights_from_disk", {"model_path": str(inside), "weight_version": "1"})
        assert status == 200 and reply["success"], reply
        assert version(engine) == "1"
        status, reply = engine.post("/update_weights_from_disk", {"model_path": str(model), "weight_version": "0"})
        assert status == 200 and reply["success"], reply  # back to the model it started with
