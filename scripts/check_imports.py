"""pyright at the root, as an editor runs it: fail on any import it cannot resolve.

The only imports allowed to stay unresolved are those of packages that the dev venv does not
install on purpose: the SGLang contract lane's (its own venv, ``.venv-sglang``) and the outside
anchors of two benches (the ``bench`` extra). Type findings are pyright's to show in an editor;
mypy is the type check of record.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Top-level module -> where it comes from.
NOT_IN_THE_DEV_VENV = {
    "sglang": "the sglang extra (contract lane: .venv-sglang)",
    "msgspec": "sglang's dependency (contract lane)",
    "fastapi": "sglang's dependency (contract lane)",
    "ray": "the bench extra (bench/bench_handoff.py)",
    "llama_cpp": "the bench extra (bench/bench_decode_limits.py)",
}
RULES = {"reportMissingImports", "reportMissingModuleSource"}


def main() -> int:
    done = subprocess.run(["pyright", "--outputjson"], capture_output=True, text=True)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
        return 2
    unresolved = []
    for d in report["generalDiagnostics"]:
        if d.get("rule") not in RULES:
            continue
        module = d["message"].split('"')[1]
        if module.split(".")[0] not in NOT_IN_THE_DEV_VENV:
            unresolved.append(f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}")
    files = report["summary"]["filesAnalyzed"]
    if unresolved:
        print(f"pyright: {len(unresolved)} unresolved import(s) in {files} files:", *unresolved, sep="\n  ")
        return 1
    print(f"pyright: every import resolves in {files} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
