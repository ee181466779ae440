"""A bad-input sweep of the command line and the Python API (issue 28's classes of fault), with counts.

Every case runs in its own subprocess, in a fresh scratch directory that holds a file of the user's
(``precious/thesis.tex``), under a time limit, and is classified:

- ``refused``: exit status 2 (the CLI's user error) or a ``LonglabError`` (the API), the message names the
  expected words, no traceback, nothing left behind in the scratch directory, the user's file intact;
- ``traceback``: a Python traceback on stderr; ``hang``: the time limit passed; ``silent``: the run
  succeeded where it should have been refused; ``wrong message``: refused without naming the argument;
  ``left files``: a refused run that left files behind; ``data loss``: the user's file changed or vanished.

    python bench/bad_input_sweep.py                  # every case, tiny models (about 5 minutes, one core)
    python bench/bad_input_sweep.py --out FILE.json  # the rows as JSON

Tiny models (``tiny-llama``) or a model name that is never loaded: what is measured is that each bad input
is refused before any work, not a model's answer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOMODEL = "no-such-model-is-loaded"
FIFO = "@fifo"  # replaced by the path of a FIFO made in the scratch directory

# (label, argv of `longlab` or ("api", python code), words the refusal must contain)


def ev(*args: str) -> list[str]:
    """``longlab eval`` on the tiny model into ``r`` (refused before it is made), plus ``args``."""
    return ["eval", "--model", "tiny-llama", "--out", "r", *args]


CASES: list[tuple[str, object, str]] = [
    (
        "train drope --out DIR of the user's",
        ["train", "drope", "--model", NOMODEL, "--out", "precious"],
        "--out",
    ),
    ("train drope --out .", ["train", "drope", "--model", NOMODEL, "--out", "."], "--out"),
    (
        "train drope --out under a file",
        ["train", "drope", "--model", NOMODEL, "--out", "precious/thesis.tex/x"],
        "--out",
    ),
    (
        "train indexmem --out the user's file",
        ["train", "indexmem", "--model", NOMODEL, "--out", "precious/thesis.tex"],
        "--out",
    ),
    (
        "calibrate --out the user's file",
        ["calibrate", "pmkvq", "--model", NOMODEL, "--budget-mb", "1", "--out", "precious/thesis.tex"],
        "--out",
    ),
    (
        "lab train --out the user's dir",
        [
            "lab",
            "train",
            "--mixer",
            "softmax",
            "--task",
            "mqar",
            "--steps",
            "5",
            "--train-len",
            "64",
            "--out",
            "precious",
        ],
        "--out",
    ),
    ("eval --skip-rows FIFO", ev("--skip-rows", FIFO), "--skip-rows"),
    ("eval --jsonl FIFO", ev("--jsonl", FIFO), "--jsonl"),
    ("eval --jsonl directory", ev("--jsonl", "precious"), "--jsonl"),
    ("eval --jsonl /dev/null", ev("--jsonl", "/dev/null"), "--jsonl"),
    ("train --seq-len 1e9", ["train", "drope", "--model", NOMODEL, "--seq-len", "1000000000"], "--seq-len"),
    (
        "eval --reuse --lengths 1e8",
        ev("--reuse", "epic", "--tasks", "multidoc_qa_1", "--lengths", "100000000"),
        "--lengths",
    ),
    (
        "eval --speculative --lengths 1e8",
        ev("--speculative", "lookup", "--lengths", "100000000"),
        "--lengths",
    ),
    ("inftythink:segment=1e12", ev("--recipes", "inftythink:segment=999999999999"), "segment"),
    ("xattention:bq=1e12", ev("--recipes", "xattention:bq=999999999999"), "bq"),
    (
        "dustin page_size huge",
        ev("--speculative", "lookup", "--verify", "dustin:page_size=999999999999"),
        "page_size",
    ),
    (
        "generate 3M-char context (API)",
        (
            "api",
            "from longlab import generate\n"
            "from longlab.models import load_model\n"
            "m, t = load_model('tiny-llama')\n"
            "generate(m, t, 'x ' * 4_500_000, 'q?')",
        ),
        "context",
    ),
    (
        "eval --reuse --max-new-tokens 0",
        ev("--reuse", "epic", "--tasks", "multidoc_qa_1", "--max-new-tokens", "0"),
        "--max-new-tokens",
    ),
    ("eval --speculative --limit -1", ev("--speculative", "lookup", "--limit", "-1"), "--limit"),
    ("eval --threads -1", ev("--threads", "-1"), "--threads"),
    ("eval --num-docs without multidoc", ev("--num-docs", "4"), "--num-docs"),
    ("eval --verify without --speculative", ev("--verify", "full"), "--verify"),
    ("eval --recipes yarn (a position method)", ev("--recipes", "full,yarn:factor=2"), "position"),
    (
        "generate --docs --chunk-size 0",
        [
            "generate",
            "--model",
            NOMODEL,
            "--docs",
            "precious/thesis.tex",
            "--question",
            "q",
            "--chunk-size",
            "0",
        ],
        "--chunk-size",
    ),
    (
        "generate --store ''",
        ["generate", "--model", NOMODEL, "--docs", "precious/thesis.tex", "--question", "q", "--store", ""],
        "--store",
    ),
    ("store rm on a missing store", ["store", "rm", "--store", "nostore", "abc"], "store"),
    ("store gc on a missing store", ["store", "gc", "--store", "nostore"], "store"),
    ("yarn:attention_factor=1e30", ev("--positions", "yarn:attention_factor=1e30"), "attention_factor"),
    ("ntk:factor=1e30", ev("--positions", "ntk:factor=1e30"), "factor"),
    ("pyramidkv:beta=-1", ev("--recipes", "pyramidkv@0.5:beta=-1"), "beta"),
    ("restkv:scale=1e30", ev("--recipes", "restkv@0.5:scale=1e30"), "scale"),
    ("sale:bits=1e30", ev("--recipes", "sale:bits=1e30"), "bits"),
    (
        "cacheblend:recompute=1e30",
        ev("--reuse", "cacheblend:recompute=1e30", "--tasks", "multidoc_qa_1"),
        "recompute",
    ),
    (
        "ape:temperature=1e30",
        ev("--reuse", "ape:temperature=1e30", "--tasks", "multidoc_qa_1"),
        "temperature",
    ),
    ("snapkv@Arabic-Indic digits", ev("--recipes", "snapkv@٠.٥"), "@"),
    ("--skip-rows Infinity", ev("--skip-rows", "@infinity"), "--skip-rows"),
    ("--skip-rows deep nesting", ev("--skip-rows", "@deep"), "--skip-rows"),
    ("JSONL answers: []", ev("--jsonl", "@noanswers"), "answers"),
    (
        "train --seed 2**70",
        ["train", "drope", "--model", NOMODEL, "--seed", "1180591620717411303424"],
        "--seed",
    ),
    ("train indexmem --steps", ["train", "indexmem", "--model", NOMODEL, "--steps", "5"], "--steps"),
    (
        "train indexmem --params",
        ["train", "indexmem", "--model", NOMODEL, "--params", "cycles=2"],
        "--params",
    ),
    (
        "calibrate --target-tokens 1e12",
        [
            "calibrate",
            "pmkvq",
            "--model",
            NOMODEL,
            "--budget-mb",
            "1",
            "--target-tokens",
            "1000000000000",
            "--out",
            "a.json",
        ],
        "--target-tokens",
    ),
    (
        "lab train mixer param 1e30",
        [
            "lab",
            "train",
            "--mixer",
            "race:tables=1000000000000",
            "--task",
            "mqar",
            "--steps",
            "5",
            "--train-len",
            "64",
            "--out",
            "labrun",
        ],
        "tables",
    ),
]


def _prepare(scratch: Path) -> dict[str, str]:
    (scratch / "precious").mkdir()
    (scratch / "precious" / "thesis.tex").write_text("data\n")
    os.mkfifo(scratch / "fifo")
    (scratch / "infinity.json").write_text('{"rows": Infinity}')
    (scratch / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (scratch / "noanswers.jsonl").write_text(
        json.dumps({"context": "a b c", "question": "q?", "answers": []}) + "\n"
    )
    return {
        FIFO: str(scratch / "fifo"),
        "@infinity": str(scratch / "infinity.json"),
        "@deep": str(scratch / "deep.json"),
        "@noanswers": str(scratch / "noanswers.jsonl"),
    }


def _snapshot(scratch: Path) -> set[str]:
    return {str(p.relative_to(scratch)) for p in scratch.rglob("*")}


def run_case(label: str, what: object, words: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="longlab-sweep-") as tmp:
        scratch = Path(tmp)
        subs = _prepare(scratch)
        before = _snapshot(scratch)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT / "src"),
            "LONGLAB_CACHE": str(scratch / ".cache"),
            "OMP_NUM_THREADS": "1",
        }
        if isinstance(what, tuple):
            code = (
                "import sys\nfrom longlab.errors import LonglabError\ntry:\n"
                + "".join(f"    {line}\n" for line in what[1].splitlines())
                + "except LonglabError as e:\n    print('longlab: error:', e, file=sys.stderr)\n"
                "    sys.exit(2)\n"
            )
            cmd = [sys.executable, "-c", code]
        else:
            cmd = [sys.executable, "-m", "longlab.cli", *[subs.get(a, a) for a in what]]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                cwd=scratch,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, err = (
                None,
                (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or ""),
            )
        seconds = time.perf_counter() - t0
        after = _snapshot(scratch) - {".cache"} - {p for p in _snapshot(scratch) if p.startswith(".cache")}
        intact = (scratch / "precious" / "thesis.tex").is_file() and (
            scratch / "precious" / "thesis.tex"
        ).read_text() == "data\n"
    left = sorted(after - before)
    if not intact:
        verdict = "data loss"
    elif rc is None:
        verdict = "hang"
    elif "Traceback" in err:
        verdict = "traceback"
    elif rc == 0:
        verdict = "silent"
    elif left:
        verdict = "left files"
    elif rc == 2 and words.lower() in err.lower():
        verdict = "refused"
    else:
        verdict = "wrong message"
    last = [line for line in err.strip().splitlines() if line.strip()]
    return {
        "case": label,
        "verdict": verdict,
        "rc": rc,
        "seconds": round(seconds, 1),
        "left": left[:5],
        "message": last[-1][:240] if last else "",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per case before it counts as a hang")
    p.add_argument("--only", default=None, help="run the cases whose label contains this text")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    rows = []
    for label, what, words in CASES:
        if args.only and args.only not in label:
            continue
        row = run_case(label, what, words, args.timeout)
        rows.append(row)
        print(f"{row['verdict']:>13}  {row['seconds']:5.1f}s  {label}: {row['message']}", flush=True)
    counts = Counter(r["verdict"] for r in rows)
    print(f"\n{len(rows)} cases: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    if args.out:
        Path(args.out).write_text(json.dumps({"counts": counts, "rows": rows}, indent=1) + "\n")
    return 0 if counts.get("refused", 0) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
