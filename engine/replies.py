"""Reply bodies in SGLang's shapes, built from scheduler snapshots."""

from __future__ import annotations

from typing import Any

from rollout_bus.engine.codec import Codec
from rollout_bus.engine.sequence import Progress


def generate_reply(progress: Progress, codec: Codec) -> dict[str, Any]:
    """The /generate reply of one sequence: ``text``, ``output_ids`` and ``meta_info``."""
    spec = progress.spec
    params = spec.params
    meta: dict[str, Any] = {
        "id": spec.rid,
        "finish_reason": progress.finish,
        "prompt_tokens": len(spec.input_ids),
        "weight_version": progress.weight_version,
        "num_retractions": progress.retractions,
    }
    if spec.return_logprob:
        meta["output_token_logprobs"] = [
            [logprob, token, codec.decode([token], params.skip_special_tokens) if spec.return_text_in_logprobs else None]
            for logprob, token in zip(progress.logprobs, progress.output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = len(progress.output_ids)
    meta.update(reasoning_tokens=0, completion_tokens=len(progress.output_ids),
                cached_tokens=progress.cached_tokens,
                e2e_latency=round(progress.e2e_latency, 6))
    spans = version_spans(progress.versions)
    if len(spans) > 1:
        meta["weight_versions"] = spans
    return {"text": _text(progress, codec), "output_ids": list(progress.output_ids), "meta_info": meta}


def version_spans(versions: tuple[str, ...]) -> list[dict[str, Any]]:
    """Runs of equal versions as ``[{"version", "start", "end"}]`` over output token indices, end exclusive."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    return spans


def _text(progress: Progress, codec: Codec) -> str:
    params = progress.spec.params
    ids = list(progress.output_ids)
    finish = progress.finish or {}
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    if isinstance(matched, int) and not params.no_stop_trim:
        ids = ids[:-1]
    text = codec.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim and text.endswith(matched):
        text = text[: -len(matched)]
    return text
