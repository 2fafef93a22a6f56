"""Weight update time of a ~500 MB Hugging Face directory: one safetensors file against 4 shards.

A random Llama of about 134M float32 parameters (~540 MB) is saved twice as a version directory with
its manifest (``lm.hf.save_version``): once as one ``model.safetensors``, once as 4 shards with an
index. One CPU engine process serves the same architecture. A trial is what a version costs from
publication to serving on one engine: the controller's check (``controller.weights.verify``: the
manifest's hash, every file's size and sha256, a NaN/inf scan of every float tensor from its raw
bits, tensor names and shapes against the served model; files in parallel, 4 threads) followed by
``POST /update_weights_from_disk`` (the engine reads the files, shards in parallel, vets names,
shapes and finite values, and copies the tensors in). Layouts alternate (ABBA); medians are reported.
The files were just written, so reads come from the page cache (the figures are warm-cache ones).
No verdict when the 1-minute load average is above 1.

    python bench/bench_hf_weights.py [--trials 4] [--hidden 768 --layers 12 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.controller.weights import reference_shapes, verify  # noqa: E402
from rollout_bus.lm import hf  # noqa: E402
from rollout_bus.lm.files import layout_files  # noqa: E402
from tests.engine_proc import EngineProcess  # noqa: E402


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return dict(json.loads(response.read()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=4, help="per layout")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=4, help="the controller's hashing threads")
    args = p.parse_args(argv)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-hf-weights-") as tmp:
        root = Path(tmp)
        model = hf.random_llama(args.vocab, hidden_size=args.hidden, layers=args.layers, heads=args.hidden // 64,
                                kv_heads=args.hidden // 64, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
                                seed=0)
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        dirs = {"single file": root / "single", "4 shards": root / "sharded"}
        tokenizer = hf.byte_tokenizer()
        shas = {"single file": hf.save_version(dirs["single file"], model, tokenizer)}
        for share in (0.26, 0.28, 0.30, 0.32, 0.34):  # transformers packs whole tensors: find a size giving 4
            shas["4 shards"] = hf.save_version(dirs["4 shards"], model, tokenizer, max_shard_size=int(total * share),
                                               replace=True)
            if len(layout_files(dirs["4 shards"])) == 4:
                break
        del model
        shards = len(layout_files(dirs["4 shards"]))
        print(f"random Llama: {total / 1e6:.0f} MB float32; single file vs {shards} shards; controller check with "
              f"{args.threads} threads; {os.cpu_count()} CPUs, load average {load_start:.2f} at start")
        reference = reference_shapes(str(dirs["single file"]))
        with EngineProcess(dirs["single file"], startup_timeout_s=300) as engine:
            times: dict[str, dict[str, list[float]]] = {k: {"check": [], "load": []} for k in dirs}
            for trial in range(2 * args.trials):
                layout = list(dirs)[0 if trial % 4 in (0, 3) else 1]
                started = time.perf_counter()
                verify("default", trial + 1, str(dirs[layout]), shas[layout], root, reference, threads=args.threads)
                checked = time.perf_counter()
                reply = post(engine.url + "/update_weights_from_disk",
                             {"model_path": str(dirs[layout]), "weight_version": str(trial + 1)})
                loaded = time.perf_counter()
                assert reply.get("success") is True, reply
                times[layout]["check"].append(checked - started)
                times[layout]["load"].append(loaded - checked)
        print(f"{'layout':>12} {'check s':>8} {'load s':>8} {'total s':>8}")
        totals = {}
        for layout, parts in times.items():
            check, load = statistics.median(parts["check"]), statistics.median(parts["load"])
            totals[layout] = statistics.median(c + x for c, x in zip(parts["check"], parts["load"], strict=True))
            print(f"{layout:>12} {check:>8.2f} {load:>8.2f} {totals[layout]:>8.2f}")
        print(f"single file / 4 shards: {totals['single file'] / totals['4 shards']:.2f}x")
    load_end = os.getloadavg()[0]
    print(f"load average {load_end:.2f} at end")
    if max(load_start, load_end) > 1.0:
        print("no verdict: the 1-minute load average was above 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
