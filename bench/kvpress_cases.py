"""Unseen long-context cases in the common JSONL format, for comparing longlab's default path with kvpress's.

    python bench/kvpress_cases.py --out runs/kvpress-cases.jsonl          # 36 cases, seed 0
    python bench/kvpress_cases.py --per-cell 8 --seed 1 --out FILE         # 48 cases

Three kinds of retrieval, none of them a longlab task generator or a RULER template, each at
``--lengths`` (default 800 and 1,600 tokens of context in SmolLM2's tokenizer):

- ``code``: one sentence "The access code for the <colour> <place> is <7 digits>." in a log-book
  haystack; asked for that code.
- ``attribute``: a register of people whose names look alike (same first names, surnames one letter
  apart), each with a home town, a trade and a pet, scattered through the haystack; asked for one
  attribute of one person.
- ``chain``: a value assigned to a variable, then passed along a chain of four more variables
  (``let kappa_17 = 48213`` ... ``let sigma_04 = kappa_17``), the lines spread through the haystack in
  order, next to a second, distractor chain; asked for every variable that ends up holding the value.

The haystack is a seeded log book: sentences drawn from small word lists (crew, task, object, place,
reading), so no two sentences repeat verbatim. Every row carries its own ``answer_prefix`` (a sentence
start without a trailing space, to which the answer is the continuation) and ``max_new_tokens``, a
``task`` and ``length``; scoring is longlab's default for an unregistered task, ``string_match_all``
(every answer contained in the prediction, case-insensitive).

The data is not committed: this script regenerates it exactly from ``--seed`` (the standard library's
``random``; the tokenizer only measures lengths).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("code", "attribute", "chain")

_CREW = ("the night shift", "the pump crew", "Inspector Hale", "the second mate", "two apprentices",
         "the duty engineer", "the harbour pilot", "Dr. Okafor", "the quartermaster", "the survey team",
         "the radio operator", "Mrs. Brandt", "the cook", "the relief crew", "the foreman")
_DID = ("checked", "cleaned", "repaired", "logged", "inspected", "painted", "moved", "tested", "measured",
        "replaced", "oiled", "sealed", "counted", "weighed", "labelled")
_THING = ("the north valve", "a cracked pulley", "the spare batteries", "the rain gauge",
          "three crates of rope", "the signal lamp", "the boiler gauge", "a leaking hose", "the tide table",
          "the winch brake",
          "the cold store", "the ballast pump", "a set of charts", "the anchor chain", "the barometer")
_WHERE = ("near the east jetty", "in the lower hold", "behind the boathouse", "on the upper deck",
          "beside the fuel shed", "in the chart room", "at the west gate", "under the main stairs",
          "in the workshop", "by the slipway", "in the storeroom", "on the breakwater")
_WHEN = ("Early in the morning", "Shortly after noon", "Before the tide turned", "At dusk", "Around midnight",
         "After breakfast", "During the afternoon watch", "Late in the evening", "At first light",
         "Before the supply boat arrived")
_NOTE = ("Nothing unusual was found.", "The reading was within limits.", "It took longer than planned.",
         "The weather stayed calm.", "A note was left for the next shift.", "The work was signed off.",
         "Wind from the south-west, light rain.", "The log was countersigned by the foreman.",
         "Two more hours were needed.", "Parts were ordered from the mainland.")

_COLOURS = ("amber", "cobalt", "crimson", "ivory", "jade", "saffron", "slate", "violet", "copper", "teal")
_PLACES = ("vault", "archive", "locker", "hangar", "greenhouse", "cellar", "pavilion", "observatory")

_FIRST = ("Lena", "Marek", "Ines", "Tomas", "Hanna", "Viktor", "Oskar", "Petra")
_SURNAMES = ("Varga", "Varda", "Vargo", "Barga", "Marga", "Vanga", "Varma", "Darga")
_TOWNS = ("Tallinn", "Porto", "Bergen", "Ghent", "Lublin", "Kassel", "Lyon", "Tartu", "Split", "Turku",
          "Aarhus", "Bilbao", "Graz", "Brno", "Malmo", "Cork")
_TRADES = ("baker", "welder", "chemist", "pilot", "carpenter", "surveyor", "librarian", "glazier", "tailor",
           "plumber", "jeweller", "printer")
_PETS = ("parrot", "tortoise", "ferret", "goldfish", "beagle", "canary", "hamster", "iguana", "rabbit",
         "tabby cat")
_ATTRIBUTES = {  # attribute -> (question, answer prefix); {name} is the person
    "town": ("Which town does {name} come from?", "{name} comes from"),
    "trade": ("What is the trade of {name}?", "{name} works as a"),
    "pet": ("Which pet does {name} keep?", "{name} keeps a"),
}
_GREEK = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "theta", "zeta", "rho",
          "tau")


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_WHEN)}, {rng.choice(_CREW)} {rng.choice(_DID)} {rng.choice(_THING)}"
    s += f" {rng.choice(_WHERE)}."
    return s + (" " + rng.choice(_NOTE) if rng.random() < 0.4 else "")


def _person(first: str, last: str, p: dict[str, str]) -> str:
    return f"{first} {last}, a {p['trade']} from {p['town']}, keeps a {p['pet']}."


def _plan(kind: str, rng: random.Random) -> dict:
    """The inserts (sentences placed in the haystack in order), question, prefix, answers, limit."""
    if kind == "code":
        colour, place = rng.choice(_COLOURS), rng.choice(_PLACES)
        code = str(rng.randint(1_000_000, 9_999_999))
        what = f"the access code for the {colour} {place}"
        return {"inserts": [f"The access code for the {colour} {place} is {code}."],
                "intro": "Below is the maintenance log of a harbour station.",
                "question": f"What is {what}?",
                "answer_prefix": f"The access code for the {colour} {place} is",
                "answers": [code], "max_new_tokens": 16}
    if kind == "attribute":
        first = rng.choice(_FIRST)
        lasts = rng.sample(_SURNAMES, 6)
        people = []
        for last in lasts:
            people.append((first, last, {"town": rng.choice(_TOWNS), "trade": rng.choice(_TRADES),
                                         "pet": rng.choice(_PETS)}))
        target = rng.randrange(len(people))
        attribute = rng.choice(tuple(_ATTRIBUTES))
        f, last, p = people[target]
        # look-alikes must not share the asked attribute's value, or the answer would be ambiguous
        for i, (_, _, other) in enumerate(people):
            while i != target and other[attribute] == p[attribute]:
                other[attribute] = rng.choice({"town": _TOWNS, "trade": _TRADES, "pet": _PETS}[attribute])
        name = f"{f} {last}"
        question, prefix = _ATTRIBUTES[attribute]
        return {"inserts": [_person(*x) for x in people],
                "intro": "Below is the log of a harbour station; it mentions several visitors.",
                "question": question.format(name=name), "answer_prefix": prefix.format(name=name),
                "answers": [p[attribute]], "max_new_tokens": 12}
    names = [f"{g}_{rng.randint(10, 99)}" for g in rng.sample(_GREEK, 10)]
    values = rng.sample(range(10_000, 100_000), 2)
    chains = [names[:5], names[5:]]
    lines = []
    for chain, value in zip(chains, values):
        lines.append([f"let {chain[0]} = {value}"] + [f"let {b} = {a}" for a, b in zip(chain, chain[1:])])
    order = sorted(range(10), key=lambda _: rng.random())  # interleave the two chains, each in order
    merged, pos = [], [0, 0]
    for k in order:
        c = k % 2
        if pos[c] < 5:
            merged.append(lines[c][pos[c]])
            pos[c] += 1
    merged += lines[0][pos[0]:] + lines[1][pos[1]:]
    return {"inserts": merged,
            "intro": "Below is the log of a harbour station; some lines assign variables.",
            "question": f"Which variables end up holding the value {values[0]}?",
            "answer_prefix": f"The variables holding {values[0]} are", "answers": list(chains[0]),
            "max_new_tokens": 32}


def _build(plan: dict, haystack: list[str], rng: random.Random) -> str:
    """The intro, then the haystack with the inserts at sorted random places."""
    spots = sorted(rng.sample(range(1, len(haystack)), len(plan["inserts"])))
    out, j = [], 0
    for i, sentence in enumerate(haystack):
        while j < len(spots) and spots[j] == i:
            out.append(plan["inserts"][j])
            j += 1
        out.append(sentence)
    return plan["intro"] + "\n\n" + " ".join(out)


def make_cases(tokenizer, lengths: list[int], per_cell: int, seed: int) -> list[dict]:
    """``per_cell`` cases per (kind, length): each context within 2% of its length in tokens."""
    cases = []
    for kind in KINDS:
        for length in lengths:
            for i in range(per_cell):
                rng = random.Random(f"{seed}:{kind}:{length}:{i}")
                plan = _plan(kind, rng)
                haystack = [_sentence(rng) for _ in range(length)]
                n = max(len(plan["inserts"]) + 2, length // 20)
                layout_seed = rng.random()
                while True:  # grow or shrink the haystack to the target length (token count of the context)
                    context = _build(plan, haystack[:n], random.Random(layout_seed))
                    have = len(tokenizer(context, add_special_tokens=False)["input_ids"])
                    if abs(have - length) <= 0.02 * length or n >= len(haystack):
                        break
                    n = max(len(plan["inserts"]) + 2, round(n * length / have))
                cases.append({
                    "context": context, "question": plan["question"], "answer_prefix": plan["answer_prefix"],
                    "answers": plan["answers"], "max_new_tokens": plan["max_new_tokens"], "task": kind,
                    "length": length, "sample_id": f"{kind}-{length}-{i}",
                    "metadata": {"context_tokens": have, "seed": seed, "generator": "bench/kvpress_cases.py"},
                })
    return cases


def _ours(path: Path) -> bool:
    """Whether ``path`` is a cases file this script wrote (its first row names the generator)."""
    try:
        with path.open(encoding="utf-8") as fh:
            first = json.loads(fh.readline(1_000_000))
        return first.get("metadata", {}).get("generator") == "bench/kvpress_cases.py"
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--lengths", default="800,1600", help="context lengths in tokens, comma-separated")
    p.add_argument("--per-cell", type=int, default=6, help="cases per (kind, length); 6 -> 36 cases")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        lengths = []
    if not lengths or any(not 200 <= n <= 32_768 for n in lengths):
        print(f"--lengths: integers in [200, 32768], comma-separated, got {args.lengths!r}", file=sys.stderr)
        return 2
    if not 1 <= args.per_cell <= 1000:
        print(f"--per-cell must be in [1, 1000], got {args.per_cell}", file=sys.stderr)
        return 2
    from longlab.models import load_model
    from longlab.recipe import LonglabError
    from longlab.safeio import check_output_file, write_file_atomic

    try:  # never overwrite a file this script did not write
        check_output_file(args.out, "--out", owned=_ours, what="cases file")
    except LonglabError as err:
        print(err, file=sys.stderr)
        return 2
    _, tokenizer = load_model("smollm2-135m")  # also caches the safetensors kvpress loads
    cases = make_cases(tokenizer, lengths, args.per_cell, args.seed)
    write_file_atomic(args.out, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cases), "--out")
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
