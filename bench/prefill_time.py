"""Wall time of a full-cache prefill at one length, for each chunk size (best of ``--repeats``).

    python bench/prefill_time.py --model smollm2-135m --length 4096 --chunk-sizes 1024,4096

The prompt is a RULER ``niah_single_1`` sample of ``--length`` tokens; the figure is
``GenerationResult.prefill_s`` of ``longlab.generate(..., recipe="full", max_new_tokens=1)``, i.e. the
context's chunked prefill through the longlab attention hook. Writes JSON with the machine header.
"""

from __future__ import annotations

import argparse

import torch
from common import hardware, write_json

from longlab import generate, load_model
from longlab.tasks import generate_samples as make_samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunk-sizes", default="1024,4096")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench/results/prefill_time.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    (sample,) = make_samples("niah_single_1", tokenizer, args.length, 1, 0)
    rows = []
    for chunk in (int(c) for c in args.chunk_sizes.split(",")):
        times = []
        for _ in range(max(1, args.repeats)):
            result = generate(
                model, tokenizer, sample.context, sample.question, "full", max_new_tokens=1,
                chunk_size=chunk, answer_prefix=sample.answer_prefix,
            )
            times.append(result.prefill_s)
        rows.append({"model": args.model, "context_tokens": result.context_tokens[0], "chunk_size": chunk,
                     "prefill_s": min(times), "all_s": times})
        print(f"{args.model}: {result.context_tokens[0]} tokens, chunk {chunk}: prefill {min(times):.1f} s "
              f"(best of {len(times)}; {torch.get_num_threads()} threads)", flush=True)
    print(f"wrote {write_json(args.out, {'hardware': hardware(), 'args': vars(args), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
