"""The weights-directory format shared by trainers, the controller and engines (no torch import).

A published version is a Hugging Face directory:

- full weights: ``config.json``, the weights as ``model.safetensors`` or as shards
  ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, and whatever else
  ``save_pretrained`` writes (generation config, tokenizer files);
- a LoRA adapter in PEFT format: ``adapter_config.json`` and ``adapter_model.safetensors``;
- ``manifest.json``, written last by the publisher: the kind of the directory, the policy and version
  it publishes, and the size and sha256 of every other file in it. The sha256 of the manifest's own
  bytes names the version (``WeightsPublished.sha256``), so one small hash pins every byte of the
  directory and what it claims to be. A directory that is not a publication (a model directory)
  names no policy or version; format 1 manifests (before the policy and version) still read as such.

``write_weights_dir`` fills a temporary sibling directory, writes the manifest, then renames it
into place: a partially written version is never visible under its final name.
``verify_weights_dir`` checks a directory against a published manifest hash (every file hashed
once, in parallel, and every float tensor scanned for NaN and infinity from its raw bits, so the
check needs numpy only). ``tensor_shapes`` reads names, dtypes and shapes from safetensors
headers across shards; ``adapter_problems`` says why an adapter does not fit a base model.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rollout_bus.events.errors import Failure

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "rollout-bus-weights/2"
MANIFEST_FORMATS = ("rollout-bus-weights/1", MANIFEST_FORMAT)
"""Formats read; 1 has no ``policy`` and ``version`` (nothing written by it is a publication the controller takes)."""
MAX_HEADER_BYTES = 100 << 20
DEFAULT_THREADS = 4

Kind = Literal["full", "adapter"]
Shapes = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (safetensors dtype, shape)."""

# Bits that are all set exactly when a value is NaN or infinite, per safetensors float dtype.
_NONFINITE: dict[str, tuple[Any, int]] = {
    "F64": (np.uint64, 0x7FF0000000000000),
    "F32": (np.uint32, 0x7F800000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F),
}
_SCAN_ELEMENTS = 1 << 24


class WeightsError(Failure):
    """A weights directory or file that must not be used; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def weights_file(path: str | os.PathLike[str]) -> Path:
    """The safetensors file meant by ``path``: the file itself, or ``model.safetensors`` in a directory."""
    path = Path(path)
    return path if path.suffix == ".safetensors" else path / WEIGHTS_FILE


def config_file(path: str | os.PathLike[str]) -> Path:
    """The ``config.json`` that describes the weights at ``path`` (it sits beside the weights file)."""
    return weights_file(path).parent / CONFIG_FILE


def version_dir(weights_root: str | os.PathLike[str], policy: str, version: int) -> Path:
    """Where a published version of ``policy`` lies: ``<weights_root>/<policy>/v<version:06d>``."""
    return Path(weights_root) / policy / f"v{version:06d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --- the manifest ---------------------------------------------------------------------------

@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    kind: Kind
    files: dict[str, FileEntry]
    policy: str | None = None
    """The policy this directory publishes (None: not a publication, e.g. a model directory)."""
    version: int | None = None

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "format": MANIFEST_FORMAT, "kind": self.kind,
            "files": {name: {"sha256": e.sha256, "bytes": e.bytes} for name, e in sorted(self.files.items())}}
        if self.policy is not None:
            body["policy"] = self.policy
        if self.version is not None:
            body["version"] = self.version
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        try:
            body = json.loads(raw)
            if body.get("format") not in MANIFEST_FORMATS:
                raise ValueError(f"format is {body.get('format')!r}, expected one of {list(MANIFEST_FORMATS)}")
            if body.get("kind") not in ("full", "adapter"):
                raise ValueError(f"kind is {body.get('kind')!r}, expected 'full' or 'adapter'")
            files = {str(name): FileEntry(str(e["sha256"]), int(e["bytes"])) for name, e in body["files"].items()}
            policy, version = body.get("policy"), body.get("version")
            if policy is not None and not isinstance(policy, str):
                raise ValueError(f"policy is {policy!r}, expected a string")
            if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
                raise ValueError(f"version is {version!r}, expected a non-negative integer")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise WeightsError(f"malformed {MANIFEST_FILE}: {exc}") from None
        for name in files:
            _check_member_name(name)
        return cls(body["kind"], files, policy, version)


def weights_kind(directory: Path) -> Kind:
    """``adapter`` for a PEFT adapter directory, else ``full``."""
    return "adapter" if (directory / ADAPTER_CONFIG_FILE).is_file() else "full"


def build_manifest(directory: Path, *, threads: int = DEFAULT_THREADS, policy: str | None = None,
                   version: int | None = None) -> Manifest:
    """The manifest of every regular file in ``directory`` (not recursive; no links, no subfolders),
    naming the ``policy`` and ``version`` it publishes when it is a publication."""
    names: list[str] = []
    for entry in sorted(directory.iterdir()):
        if entry.name == MANIFEST_FILE:
            continue
        if entry.is_symlink() or not entry.is_file():
            raise WeightsError(f"{entry} is not a regular file: a weights directory holds only plain files")
        names.append(entry.name)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        digests = list(pool.map(lambda n: sha256_file(directory / n), names))
    files = {n: FileEntry(d, (directory / n).stat().st_size) for n, d in zip(names, digests, strict=True)}
    return Manifest(weights_kind(directory), files, policy, version)


def write_manifest(directory: Path, *, threads: int = DEFAULT_THREADS, policy: str | None = None,
                   version: int | None = None) -> str:
    """Write ``manifest.json`` for ``directory``; return its sha256 (the version's name)."""
    raw = build_manifest(directory, threads=threads, policy=policy, version=version).to_bytes()
    (directory / MANIFEST_FILE).write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


def read_manifest(directory: Path) -> tuple[Manifest, str]:
    """The manifest of ``directory`` and the sha256 of its bytes."""
    try:
        raw = (directory / MANIFEST_FILE).read_bytes()
    except OSError as exc:
        raise WeightsError(f"no readable {MANIFEST_FILE} in {directory}: {exc.strerror or exc}") from None
    return Manifest.from_bytes(raw), hashlib.sha256(raw).hexdigest()


def write_weights_dir(final: Path, fill: Callable[[Path], object], *, threads: int = DEFAULT_THREADS,
                      replace: bool = False, same_ok: bool = False,
                      before_rename: Callable[[], object] | None = None, policy: str | None = None,
                      version: int | None = None) -> str:
    """Write a version directory atomically: ``fill(tmp)`` writes the files into a temporary sibling,
    the manifest (naming ``policy`` and ``version`` for a publication) is added, then the directory is
    renamed to ``final``. Returns the manifest sha256.

    An existing ``final`` is an error (``FileExistsError``) unless ``replace`` (then the old one is
    removed after the rename), or ``same_ok`` and its manifest is the one just written (then nothing
    changes: saving a version again with the same bytes). Without ``replace`` the rename never
    replaces anything (``rename_noreplace``), even a directory that appeared while the files were
    written. ``before_rename`` runs once the files are written, right before the comparison and the
    rename (a writer's lease check): what it raises aborts the write and leaves nothing behind.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not (replace or same_ok):
        raise FileExistsError(f"{final} exists; a published version is never rewritten")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        fill(tmp)
        digest = write_manifest(tmp, threads=threads, policy=policy, version=version)
        if before_rename is not None:
            before_rename()
        if same_ok and not replace and final.exists():
            existing = _manifest_digest(final)
            if existing == digest:
                shutil.rmtree(tmp, ignore_errors=True)
                return digest
            raise FileExistsError(f"{final} exists with other content (manifest sha256 {existing}, this write "
                                  f"{digest}); a published version is never rewritten")
        if replace and final.exists():
            old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.old")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            rename_noreplace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return digest


def _manifest_digest(directory: Path) -> str | None:
    try:
        return read_manifest(directory)[1]
    except (OSError, WeightsError):
        return None


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (``FileExistsError``), atomically where the kernel can
    (``renameat2(RENAME_NOREPLACE)``); elsewhere a check then ``os.rename``, which replaces at most an empty
    directory that appeared between the two."""
    libc = _libc()
    rename2 = getattr(libc, "renameat2", None) if libc is not None else None
    if rename2 is not None:
        if rename2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, f"{dst} exists; it is never replaced", str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: a filesystem without the flag
            raise OSError(err, os.strerror(err), str(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, f"{dst} exists; it is never replaced", str(dst))
    os.rename(src, dst)


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# --- checking a directory ----------------------------------------------------------------------

def verify_weights_dir(directory: Path, sha256: str, *, threads: int = DEFAULT_THREADS,
                       check_values: bool = True) -> Manifest:
    """Check ``directory`` against the published manifest hash; ``WeightsError`` says what is wrong.

    The manifest's bytes must hash to ``sha256``; every listed file must exist with its size and
    sha256; no other file may be there; the weight files the layout names (index and shards, or the
    single file, or the adapter) must all be listed; with ``check_values`` every float tensor is
    scanned for NaN and infinity. Files are checked in parallel (hashing releases the GIL).
    """
    manifest, actual = read_manifest(directory)
    if actual != sha256.lower():
        raise WeightsError(f"manifest mismatch: sha256 of {directory / MANIFEST_FILE} is {actual}, published {sha256}")
    present = {p.name for p in directory.iterdir() if p.name != MANIFEST_FILE}
    unlisted = sorted(present - set(manifest.files))
    if unlisted:
        raise WeightsError(f"files not in the manifest: {unlisted[:4]}")
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise WeightsError(f"missing {'shard' if any(m.endswith('.safetensors') for m in missing) else 'file'}"
                           f"(s) listed in the manifest: {missing[:4]}")
    weight_files = layout_files(directory, manifest.kind)
    not_listed = sorted(set(weight_files) - set(manifest.files))
    if not_listed:
        raise WeightsError(f"missing shard(s) named by the layout: {not_listed[:4]}")

    def check(name: str) -> str | None:
        path = directory / name
        entry = manifest.files[name]
        if path.is_symlink() or not path.is_file():
            return f"{name} is not a regular file"
        size = path.stat().st_size
        if size != entry.bytes:
            return f"manifest mismatch: {name} has {size} bytes, the manifest says {entry.bytes}"
        digest = sha256_file(path)
        if digest != entry.sha256:
            return f"manifest mismatch: sha256 of {name} is {digest}, the manifest says {entry.sha256}"
        if check_values and name in weight_files:
            bad = nonfinite_tensors(path)
            if bad:
                return f"non-finite values (NaN or infinity) in {name}: {bad[:4]}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        problems = [p for p in pool.map(check, sorted(manifest.files)) if p]
    if problems:
        raise WeightsError("; ".join(problems[:4]))
    return manifest


def layout_files(directory: Path, kind: Kind | None = None) -> list[str]:
    """The safetensors files that hold the weights: the adapter file, the shards the index names,
    or ``model.safetensors``. ``WeightsError`` when the layout is unusable."""
    kind = kind or weights_kind(directory)
    if kind == "adapter":
        if not (directory / ADAPTER_CONFIG_FILE).is_file():
            raise WeightsError(f"{directory} is an adapter without {ADAPTER_CONFIG_FILE}")
        return [ADAPTER_WEIGHTS_FILE]
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(f"unreadable {INDEX_FILE} in {directory}: {exc}") from None
        for name in shards:
            _check_member_name(name)
        return shards
    if (directory / WEIGHTS_FILE).is_file() or not any(directory.glob("*.safetensors")):
        return [WEIGHTS_FILE]
    raise WeightsError(f"{directory} has safetensors shards but no {INDEX_FILE}")


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The JSON header of a safetensors file (``__metadata__`` dropped); ``WeightsError`` if unreadable."""
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise WeightsError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > MAX_HEADER_BYTES:
                raise WeightsError(f"{path} is not a safetensors file (header of {length} bytes)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise WeightsError(f"missing weights file {path}") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{path} is not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path} has a malformed safetensors header")
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def file_shapes(path: Path) -> Shapes:
    header = read_header(path)
    try:
        return {name: (str(info.get("dtype")), tuple(_dim(d) for d in info.get("shape", [])))
                for name, info in header.items()}
    except (TypeError, ValueError) as exc:
        raise WeightsError(f"{path} has a malformed safetensors header: {exc}") from None


def _dim(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"shape entry {value!r} is not a size")
    return value


def tensor_shapes(path: Path) -> Shapes:
    """Every tensor of a weights location (a directory in any layout, or one safetensors file).

    For a sharded directory each tensor must sit in the shard the index names for it."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return file_shapes(path)
    shapes: Shapes = {}
    files = layout_files(path)
    for name in files:
        for tensor, info in file_shapes(path / name).items():
            if tensor in shapes:
                raise WeightsError(f"tensor {tensor} is stored twice (again in {name})")
            shapes[tensor] = info
    index = path / INDEX_FILE
    if len(files) > 1 or index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        absent = sorted(set(weight_map) - set(shapes))
        if absent:
            raise WeightsError(f"{INDEX_FILE} names tensors no shard holds: {absent[:4]}")
    return shapes


def nonfinite_tensors(path: Path) -> list[str]:
    """Names of the float tensors in a safetensors file that hold a NaN or an infinity.

    Read from the raw bits (all exponent bits set), chunk by chunk, through a read-only memory map.
    """
    header = read_header(path)
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    data_start = 8 + length
    size = path.stat().st_size
    if size == data_start:
        return []
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    bad: list[str] = []
    for name, info in header.items():
        spec = _NONFINITE.get(str(info.get("dtype")))
        if spec is None:
            continue
        word, mask = spec
        start, end = _data_offsets(path, name, info, size - data_start, np.dtype(word).itemsize)
        values = buffer[data_start + start:data_start + end].view(word)
        for lo in range(0, values.size, _SCAN_ELEMENTS):
            if bool(((values[lo:lo + _SCAN_ELEMENTS] & word(mask)) == word(mask)).any()):
                bad.append(name)
                break
    del buffer
    return bad


def _data_offsets(path: Path, name: str, info: Mapping[str, Any], data_bytes: int, itemsize: int) -> tuple[int, int]:
    """A tensor's ``data_offsets`` when they lie inside the file's data and hold whole elements."""
    offsets = info.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)):
        raise WeightsError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, expected [start, end]")
    start, end = offsets
    if not 0 <= start <= end <= data_bytes:
        raise WeightsError(f"{path}: tensor {name!r} has data_offsets [{start}, {end}] outside the file's "
                           f"{data_bytes} bytes of data")
    if (end - start) % itemsize:
        raise WeightsError(f"{path}: tensor {name!r} has data_offsets [{start}, {end}]: {end - start} bytes, not a "
                           f"whole number of {itemsize}-byte elements")
    return start, end


# --- adapters against a base model --------------------------------------------------------------

ADAPTER_PREFIX = "base_model.model."


def adapter_problems(adapter: Shapes, base: Mapping[str, tuple[str, tuple[int, ...]]], limit: int = 4) -> list[str]:
    """Why a PEFT LoRA adapter (its tensor shapes) does not fit a base model (its tensor shapes).

    ``base_model.model.<module>.lora_A.weight`` is ``[r, in]`` and ``lora_B.weight`` is ``[out, r]``
    for a base ``<module>.weight`` of shape ``[out, in]``."""
    problems: list[str] = []
    lora = [n for n in adapter if ".lora_A." in n or ".lora_B." in n]
    if not lora:
        problems.append("the adapter holds no LoRA tensors (lora_A / lora_B)")
    for name in sorted(lora):
        module, part = _lora_module(name)
        target = base.get(f"{module}.weight")
        shape = adapter[name][1]
        if target is None:
            problems.append(f"{name}: the base model has no {module}.weight")
            continue
        base_shape = target[1]
        if len(shape) != 2 or len(base_shape) != 2:
            problems.append(f"{name}: shape {list(shape)} against base {list(base_shape)}")
        elif part == "lora_A" and shape[1] != base_shape[1]:
            problems.append(f"{name}: input size {shape[1]}, but {module}.weight has shape {list(base_shape)}")
        elif part == "lora_B" and shape[0] != base_shape[0]:
            problems.append(f"{name}: output size {shape[0]}, but {module}.weight has shape {list(base_shape)}")
        if len(problems) >= limit:
            break
    return problems


def _lora_module(name: str) -> tuple[str, str]:
    """``base_model.model.x.y.lora_A.weight`` -> (``x.y``, ``lora_A``)."""
    stem = name.removeprefix(ADAPTER_PREFIX)
    for part in ("lora_A", "lora_B"):
        marker = f".{part}."
        if marker in stem:
            return stem.split(marker, 1)[0], part
    return stem, ""


def _check_member_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise WeightsError(f"file name {name!r} in a weights directory must be a plain file name")



def weights_root_problem(root: str) -> str | None:
    """Why this host cannot use ``root`` as the weights root (None: it can).

    Weights travel between hosts through a filesystem every host mounts at the same path (NFS, a
    shared volume): the trainer writes a version directory there, the controller checks it and the
    engines load it. A host that does not see the directory cannot take part.
    """
    import socket

    path = Path(root)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        return (f"weights root {root!r} {what} on host {socket.gethostname()!r}: weights travel through a "
                "filesystem every host mounts at the same path (the trainer's, the controller's and the engines' "
                "hosts); mount it here, or create it on the shared filesystem")
    if not os.access(path, os.R_OK | os.X_OK):
        return f"weights root {root!r} is not readable on host {socket.gethostname()!r}: check its permissions"
    return None


# --- the digest of the tensors a directory holds -------------------------------------------------

DIGEST_ALGORITHM = "rollout-bus-tensors-sha256/1"
"""``tensors_digest``: sha256 over lines ``<name> <dtype> <shape> <sha256 of the tensor's bytes>\\n``, sorted by name."""


def tensor_line(name: str, dtype: str, shape: tuple[int, ...] | list[int], data: Any) -> bytes:
    """One tensor's part of the digest: its name, safetensors dtype, shape and the sha256 of its raw
    (little-endian, row-major) bytes. ``data`` is anything ``hashlib`` reads (bytes, a memoryview, a
    contiguous numpy array)."""
    dims = ",".join(str(int(d)) for d in shape)
    return f"{name} {dtype} [{dims}] {hashlib.sha256(data).hexdigest()}\n".encode()


def combine_digest(lines: Mapping[str, bytes]) -> str:
    """The digest of a set of tensors from their ``tensor_line``s (name -> line): order and sharding do not
    count, only names, dtypes, shapes and bytes."""
    digest = hashlib.sha256(DIGEST_ALGORITHM.encode() + b"\n")
    for name in sorted(lines):
        digest.update(lines[name])
    return digest.hexdigest()


def file_tensor_lines(path: Path) -> dict[str, bytes]:
    """``tensor_line`` of every tensor of one safetensors file, read through a read-only memory map."""
    header = read_header(path)
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    data_start = 8 + length
    size = path.stat().st_size
    buffer = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    lines: dict[str, bytes] = {}
    try:
        for name, info in header.items():
            shape = info.get("shape")
            if not isinstance(shape, list):
                raise WeightsError(f"{path}: tensor {name!r} has shape {shape!r}, expected a list")
            start, end = _data_offsets(path, name, info, size - data_start, 1)
            lines[name] = tensor_line(name, str(info.get("dtype")), [_dim(d) for d in shape],
                                      buffer[data_start + start:data_start + end])
    finally:
        del buffer
    return lines


def tensors_digest(path: Path, *, threads: int = DEFAULT_THREADS) -> str:
    """The digest (``DIGEST_ALGORITHM``) of every tensor of a weights location: a directory in any layout
    (full weights, shards, an adapter) or one safetensors file. The same tensors give the same digest
    however they are split into shards; ``lm.hf.state_digest`` computes it from tensors in memory."""
    path = Path(path)
    files = [path] if path.suffix == ".safetensors" else [path / name for name in layout_files(path)]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as pool:
        parts = list(pool.map(file_tensor_lines, files))
    lines: dict[str, bytes] = {}
    for file, part in zip(files, parts, strict=True):
        twice = sorted(set(part) & set(lines))
        if twice:
            raise WeightsError(f"tensor {twice[0]} is stored twice (again in {file.name})")
        lines.update(part)
    return combine_digest(lines)
