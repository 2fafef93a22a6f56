"""Checking published weights before any engine sees them.

A ``WeightsPublished`` uri is a version directory (a path, or a ``file://`` URL) in the format of
``lm.files``: full Hugging Face weights (one file, or shards with their index) or a PEFT LoRA
adapter, with the manifest its publisher wrote; the published sha256 is the manifest's. It is
refused when it resolves (symlinks included) outside the weights root or outside the folder of the
event's policy (``<root>/<policy>/``), when the manifest does not hash to the published sha256, when
the manifest names another policy or version than the event (or none: a format 1 manifest), when a
file is missing, unlisted or differs from the manifest (every
file hashed once here, in parallel: engines do not hash again), when a tensor holds NaN or
infinity, when full weights' tensor names and shapes differ from the model the engines run, or when
an adapter does not fit that model. Everything is read from file headers and raw bits: the
controller needs no torch. Any other error reading the directory is a refusal too, with its reason.

A directory that is not there yet is ``transient``: a shared mount may show it a moment later, so
the caller tries again before the refusal is final.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from rollout_bus.controller.versions import Target
from rollout_bus.events.errors import Failure
from rollout_bus.events.schema import Producer
from rollout_bus.lm.files import (
    ADAPTER_WEIGHTS_FILE,
    Shapes,
    WeightsError,
    adapter_problems,
    file_shapes,
    tensor_shapes,
    tensors_digest,
    verify_weights_dir,
)


class BadWeights(Failure):
    """Published weights that must not reach an engine; ``reason`` says why. ``transient``: the directory
    is not visible (yet); the same publication may pass a moment later."""

    def __init__(self, reason: str, *, transient: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transient = transient


def uri_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(unquote(urlsplit(uri).path))
    if "://" in uri:
        raise BadWeights(f"unsupported weights uri {uri!r}: only local paths and file:// are supported")
    return Path(uri)


def shape_problems(reference: Shapes, candidate: Shapes, limit: int = 4) -> list[str]:
    problems: list[str] = []
    missing = sorted(set(reference) - set(candidate))
    unexpected = sorted(set(candidate) - set(reference))
    if missing:
        problems.append(f"missing tensors {missing[:limit]}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:limit]}")
    for name in sorted(set(reference) & set(candidate)):
        if reference[name][1] != candidate[name][1]:
            problems.append(f"{name}: shape {list(candidate[name][1])}, expected {list(reference[name][1])}")
    return problems[:limit + 2]


def writer_problem(producer: Producer, policy: str, lease_owner: str | None) -> str | None:
    """Why ``producer`` may not publish ``policy``'s weights (None: it may).

    Redis ACLs cannot scope the shared weights stream to one policy's trainer, so the reader checks
    the writer: while a trainer holds the policy's lease (``lease_owner``, ``<trainer_id>/<dp_size>``),
    only that trainer's producer (``<instance>-<trainer_id>``) publishes its versions. With no lease
    (a replay, an operator's publish, a trainer that finished) the manifest check stands alone."""
    if lease_owner is None:
        return None
    trainer_id = lease_owner.split("/", 1)[0]
    if producer.role == "trainer" and producer.instance.endswith(f"-{trainer_id}"):
        return None
    return (f"published by {producer}, but the lease of policy {policy!r} is held by trainer {trainer_id!r}: "
            "only the lease holder publishes the policy's versions")


def reference_shapes(model_path: str) -> Shapes | None:
    """Tensor shapes of the model the engines were launched with, when it is a local directory."""
    if not model_path or not Path(model_path).is_dir():
        return None
    try:
        return tensor_shapes(Path(model_path))
    except WeightsError as exc:
        raise BadWeights(exc.reason) from None


def verify(policy: str, version: int, uri: str, sha256: str, root: Path, reference: Shapes | None, *,
           threads: int = 4) -> Target:
    """The ``Target`` for a publication, or ``BadWeights`` with the reason (blocking: hashes every file)."""
    root = root.resolve()
    raw = uri_path(uri)
    if not raw.is_absolute():
        raw = root / raw
    try:
        resolved = raw.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise BadWeights(f"weights directory missing on this host: {raw} (weights travel through a filesystem "
                         "every host mounts at the same path: is the trainer's weights root mounted here?)",
                         transient=True) from None
    except OSError as exc:
        raise BadWeights(f"weights path unusable: {raw}: {exc}") from None
    if not resolved.is_relative_to(root):
        raise BadWeights(f"weights path {raw} resolves to {resolved}, outside the weights root {root}")
    folder = resolved.relative_to(root).parts
    if len(folder) < 2 or folder[0] != policy:
        raise BadWeights(f"weights path {raw} resolves to {resolved}, outside {root / policy}: a policy publishes "
                         "only under its own folder of the weights root")
    if not resolved.is_dir():
        raise BadWeights(f"weights path {raw} is not a directory: publish a version directory with its manifest")
    try:
        return _checked(policy, version, uri, sha256, resolved, reference, threads)
    except BadWeights:
        raise
    except Exception as exc:  # noqa: BLE001  # whatever reading a published directory raises is a refusal
        raise BadWeights(f"weights in {resolved} are unreadable: {type(exc).__name__}: {exc}") from None


def _checked(policy: str, version: int, uri: str, sha256: str, resolved: Path, reference: Shapes | None,
             threads: int) -> Target:
    try:
        manifest = verify_weights_dir(resolved, sha256, threads=threads)
        if (manifest.policy, manifest.version) != (policy, version):
            if manifest.policy is None or manifest.version is None:
                raise BadWeights(f"the manifest of {resolved} names no policy and version (an older publisher's "
                                 f"format): publish it again with this version of the trainer")
            raise BadWeights(f"the manifest of {resolved} publishes {manifest.policy!r} v{manifest.version}, but the "
                             f"event announces {policy!r} v{version}")
        if reference is not None:
            if manifest.kind == "adapter":
                problems = adapter_problems(file_shapes(resolved / ADAPTER_WEIGHTS_FILE), reference)
                if problems:
                    raise BadWeights("the adapter does not fit the served base model: " + "; ".join(problems))
            else:
                problems = shape_problems(reference, tensor_shapes(resolved))
                if problems:
                    raise BadWeights("wrong shapes: " + "; ".join(problems))
        digest = tensors_digest(resolved, threads=threads)
    except WeightsError as exc:
        raise BadWeights(exc.reason) from None
    return Target(policy, version, uri, sha256.lower(), str(resolved), manifest.kind, digest)
