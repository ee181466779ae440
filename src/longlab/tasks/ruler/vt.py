"""RULER's variable tracking (``vt``, Hsieh et al. 2024): multi-hop chains of assignments."""

from __future__ import annotations

import random
import string
from collections.abc import Sequence

from ..generator import Built, Plan, run
from ..haystacks import (
    NOISE,
    Tokenizer,
    join_with_inserts,
)
from ..registry import register_task
from ..sample import Sample

# --------------------------------------------------------------------------- variable tracking


def _var_names(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    out = []
    while len(out) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def _chain(names: Sequence[str], value: int) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]


_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def _vt_question(value: int) -> str:
    return f"Question: Find all variables that are assigned the value {value} in the text above."


def _vt_prefix(count: int, value: int) -> str:
    return (
        f" Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
        f"are assigned the value {value}, they are:"
    )


@register_task("vt", metric="string_match_all")
def vt(
    tokenizer: Tokenizer,
    length: int,
    num_samples: int = 1,
    seed: int = 0,
    *,
    num_chains: int = 1,
    num_hops: int = 4,
    max_new_tokens: int = 30,
) -> list[Sample]:
    """RULER variable tracking (Hsieh et al. 2024): ``VAR ABCDE = 12345`` then ``num_hops`` lines
    ``VAR B = VAR A`` hidden in order at random places of a noise haystack; the answer is every variable
    of the queried chain. Extra chains (``num_chains > 1``) are distractors. One solved example is
    prepended (a short noise haystack with its own chain).
    """
    for name, value, low in (("num_chains", num_chains, 1), ("num_hops", num_hops, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def plan(rng: random.Random, index: int) -> Plan:
        taken: set[str] = set()
        values = rng.sample(range(10_000, 100_000), num_chains + 1)
        chains = [_var_names(rng, num_hops + 1, taken) for _ in range(num_chains)]
        ex_names = _var_names(rng, num_hops + 1, taken)
        ex_value = values[-1]
        ex_lines = _chain(ex_names, ex_value)
        ex_hay, _ = join_with_inserts(
            [NOISE] * 3, list(zip(sorted(rng.random() for _ in ex_lines), ex_lines)), "\n"
        )
        example = (
            _VT_INTRO
            + ex_hay
            + "\n"
            + _vt_question(ex_value)
            + _vt_prefix(len(ex_names), ex_value)
            + " "
            + " ".join(ex_names)
            + "\n\n"
        )
        inserts: list[tuple[float, str]] = []
        for names, value in zip(chains, values):
            lines = _chain(names, value)
            inserts += list(zip(sorted(rng.random() for _ in lines), lines))
        inserts.sort(key=lambda x: x[0])

        def build(n: int) -> Built:
            hay, offsets = join_with_inserts([NOISE] * n, inserts, "\n")
            base = len(example) + len(_VT_INTRO)
            return Built(
                context=example + _VT_INTRO + hay + "\n",
                metadata={
                    "haystack_span": [base, base + len(hay)],
                    "chain_offsets": [base + o for o in offsets],
                },
            )

        return Plan(
            build=build,
            question=_vt_question(values[0]),
            answer_prefix=_vt_prefix(num_hops + 1, values[0]),
            answers=list(chains[0]),
            lo=1,
            metadata={
                "haystack": "noise",
                "haystack_source": "noise",
                "num_chains": num_chains,
                "num_hops": num_hops,
                "value": values[0],
                "chains": [_chain(c, v) for c, v in zip(chains, values)],
            },
        )

    return run("vt", tokenizer, length, num_samples, seed, plan, max_new_tokens)
