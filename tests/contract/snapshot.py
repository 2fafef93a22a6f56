"""What the project uses of SGLang, read from the installed package: request fields, sampling keys, reply
fields, launch flags and routes. ``sglang_snapshot.json`` beside this file is its output for the pinned
release; ``test_snapshot.py`` compares it with the package at hand, one test per entry (named after it).

Regenerate after a deliberate upgrade (in the lane's venv, ``scripts/sglang_contract.sh``):

    .venv-sglang/bin/python -m tests.contract.snapshot > tests/contract/sglang_snapshot.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from typing import Any

# Request fields the controller and the executors send (class -> fields).
REQUEST_FIELDS: dict[str, list[str]] = {
    "GenerateReqInput": ["input_ids", "text", "sampling_params", "return_logprob", "return_text_in_logprobs", "rid",
                         "stream", "lora_path", "priority", "custom_labels", "logprob_start_len", "top_logprobs_num"],
    "UpdateWeightFromDiskReqInput": ["model_path", "load_format", "abort_all_requests", "weight_version",
                                     "flush_cache"],
    "UpdateWeightVersionReqInput": ["new_version", "abort_all_requests"],
    "PauseGenerationReqInput": ["mode"],
    "ContinueGenerationReqInput": ["torch_empty_cache"],
    "ReleaseMemoryOccupationReqInput": ["tags"],
    "ResumeMemoryOccupationReqInput": ["tags"],
    "LoadLoRAAdapterReqInput": ["lora_name", "lora_path", "pinned"],
    "UnloadLoRAAdapterReqInput": ["lora_name"],
    "AbortReq": ["rid", "abort_all", "abort_message"],
    "LoRAUpdateOutput": ["success", "error_message", "loaded_adapters"],
    "InitWeightsUpdateGroupReqInput": ["master_address", "master_port", "rank_offset", "world_size", "group_name",
                                       "backend"],
    "UpdateWeightsFromDistributedReqInput": ["names", "dtypes", "shapes", "group_name", "flush_cache",
                                             "abort_all_requests", "weight_version", "load_format"],
    "DestroyWeightsUpdateGroupReqInput": ["group_name"],
    "InitWeightsUpdateGroupReqOutput": ["success", "message"],
    "UpdateWeightsFromDistributedReqOutput": ["success", "message"],
    "DestroyWeightsUpdateGroupReqOutput": ["success", "message"],
}
# sampling_params keys the executors send (the /generate contract gate refuses unknown ones).
SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "no_stop_trim", "n", "sampling_seed"]
# Load figures the controller reads from GET /v1/loads.
LOAD_FIELDS = ["dp_rank", "num_running_reqs", "num_waiting_reqs"]
# Flags the sglang backend puts on the launch command.
FLAGS = ["--model-path", "--host", "--port", "--weight-version", "--enable-memory-saver", "--tp-size",
         "--base-gpu-id", "--api-key", "--enable-lora", "--max-loras-per-batch", "--max-lora-rank",
         "--lora-target-modules", "--lora-paths"]
# Routes the project calls.
ROUTES = {"/generate": "POST", "/health": "GET", "/health_generate": "GET", "/model_info": "GET",
          "/server_info": "GET", "/v1/loads": "GET", "/v1/models": "GET", "/flush_cache": "POST",
          "/update_weights_from_disk": "POST", "/update_weight_version": "POST", "/pause_generation": "POST",
          "/continue_generation": "POST", "/abort_request": "POST", "/release_memory_occupation": "POST",
          "/resume_memory_occupation": "POST", "/load_lora_adapter": "POST", "/unload_lora_adapter": "POST",
          "/init_weights_update_group": "POST", "/update_weights_from_distributed": "POST",
          "/destroy_weights_update_group": "POST"}


def _field(cls: Any, name: str) -> dict[str, str]:
    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        for info in msgspec.structs.fields(cls):
            if info.name == name:
                default = "required" if info.required else repr(
                    info.default if info.default is not msgspec.NODEFAULT else info.default_factory())
                return {"type": str(info.type), "default": default}
    elif dataclasses.is_dataclass(cls):
        for info in dataclasses.fields(cls):
            if info.name == name:
                if info.default is not dataclasses.MISSING:
                    default = repr(info.default)
                elif info.default_factory is not dataclasses.MISSING:
                    default = repr(info.default_factory())
                else:
                    default = "required"
                return {"type": str(info.type), "default": default}
    return {"type": "<absent>", "default": "<absent>"}


def take() -> dict[str, Any]:
    """Every entry, as ``{"kind:name": value}``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang
        import sglang.srt.entrypoints.http_server as http_server
        from sglang.api.v1.api_types import SamplingParams as GateSamplingParams
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.load_snapshot import LoadSnapshot
        from sglang.srt.server_args import ServerArgs
    out: dict[str, Any] = {"sglang": sglang.__version__}
    for cls_name, names in REQUEST_FIELDS.items():
        cls = getattr(io_struct, cls_name, None)
        for name in names:
            out[f"field:{cls_name}.{name}"] = _field(cls, name) if cls is not None else {"type": "<no class>"}
    gate = {f.name for f in dataclasses.fields(GateSamplingParams)} if dataclasses.is_dataclass(GateSamplingParams) \
        else set(getattr(GateSamplingParams, "__struct_fields__", ()))
    for key in SAMPLING_KEYS:
        out[f"sampling:{key}"] = key in gate
    for name in LOAD_FIELDS:
        out[f"load:{name}"] = _field(LoadSnapshot, name)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    actions = {opt: action for action in parser._actions for opt in action.option_strings}
    for flag in FLAGS:
        action = actions.get(flag)
        out[f"flag:{flag}"] = None if action is None else {
            "dest": action.dest, "nargs": str(action.nargs), "type": getattr(action.type, "__name__", str(action.type)),
            "default": repr(action.default)}
    methods: dict[str, set[str]] = {}
    routes = list(http_server.app.routes)
    while routes:
        route = routes.pop()
        if hasattr(route, "original_router"):  # an included router (fastapi wraps those)
            routes.extend(route.original_router.routes)
            continue
        methods.setdefault(getattr(route, "path", ""), set()).update(getattr(route, "methods", None) or ())
    for path, method in ROUTES.items():
        out[f"route:{method} {path}"] = method in methods.get(path, set())
    return out


if __name__ == "__main__":
    json.dump(take(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
