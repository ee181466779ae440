"""RULER's question answering (``qa_1``, ``qa_2``; Hsieh et al. 2024) over synthetic documents."""

from __future__ import annotations

import random
from collections.abc import Callable

from ..generator import Built, Plan, run
from ..haystacks import (
    Tokenizer,
    words,
)
from ..registry import register_task
from ..sample import Sample

# --------------------------------------------------------------------------- QA over synthetic documents

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch dr gr kr pl sh st th tr".split()
_VOWELS = "a e i o u a e o".split()
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd"]
_CITY_SUFFIX = ["", "ford", "wick", "haven", "mouth", "dale", "bury", "port", "stead", "field"]
_PROFESSIONS = (
    "architect",
    "astronomer",
    "botanist",
    "cartographer",
    "chemist",
    "composer",
    "economist",
    "engineer",
    "geologist",
    "historian",
    "journalist",
    "linguist",
    "mathematician",
    "novelist",
    "painter",
    "pharmacist",
    "photographer",
    "physician",
    "poet",
    "sculptor",
    "surveyor",
    "translator",
    "watchmaker",
)
_SUBJECTS = (
    "mathematics",
    "chemistry",
    "history",
    "music",
    "architecture",
    "medicine",
    "law",
    "philosophy",
    "botany",
    "geology",
    "linguistics",
    "economics",
    "astronomy",
    "engineering",
)
_ORG_KINDS = (
    "Press",
    "Institute",
    "Company",
    "Orchestra",
    "Museum",
    "Foundation",
    "Laboratory",
    "Theatre",
    "Observatory",
    "Guild",
    "Academy",
    "Library",
)
_QA_INTRO = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n"
)
_QA_OUTRO = (
    "\n\nAnswer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\n"
)


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


class _World:
    """Invented people, places and organisations; names never repeat within a sample."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.names: set[str] = set()

    def _unique(self, make: Callable[[], str]) -> str:
        while True:
            x = make()
            if x not in self.names:
                self.names.add(x)
                return x

    def person(self) -> dict[str, str]:
        r = self.rng
        name = self._unique(lambda: f"{_word(r, 2).capitalize()} {_word(r, r.choice((2, 3))).capitalize()}")
        w = words()
        return {
            "name": name,
            "profession": r.choice(_PROFESSIONS),
            "birth_city": self.city(),
            "year": str(r.randint(1820, 1979)),
            "subject": r.choice(_SUBJECTS),
            "uni_city": self.city(),
            "home_city": self.city(),
            "work": f"The {r.choice(w['adjectives']).capitalize()} {r.choice(w['nouns']).capitalize()}",
        }

    def city(self) -> str:
        r = self.rng
        return (_word(r, 2) + r.choice(_CITY_SUFFIX)).capitalize()

    def org(self, founder: str) -> dict[str, str]:
        r = self.rng
        name = self._unique(lambda: f"The {_word(r, 2).capitalize()} {r.choice(_ORG_KINDS)}")
        return {
            "name": name,
            "founder": founder,
            "year": str(r.randint(1850, 2015)),
            "city": self.city(),
            "director": self._unique(lambda: f"{_word(r, 2).capitalize()} {_word(r, 2).capitalize()}"),
        }


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _bio(p: dict[str, str]) -> str:
    first = p["name"].split()[0]
    return (
        f"{p['name']} is {_a(p['profession'])} who was born in {p['birth_city']} in {p['year']}. {first} "
        f"studied {p['subject']} at the University of {p['uni_city']} and later settled in {p['home_city']}. "
        f'{p["name"]}\'s best-known work is titled "{p["work"]}".'
    )


def _org_doc(o: dict[str, str]) -> str:
    kind = o["name"].split()[-1].lower()
    return (
        f"{o['name']} is {_a(kind)} founded in {o['year']} by {o['founder']}. "
        f"It is based in {o['city']}, and its current director is {o['director']}."
    )


def _qa(
    task: str, hops: int, tokenizer: Tokenizer, length: int, num_samples: int, seed: int, max_new_tokens: int
) -> list[Sample]:
    def plan(rng: random.Random, index: int) -> Plan:
        world = _World(rng)
        gold_person = world.person()
        if hops == 1:
            kind, q, answer = rng.choice(
                [
                    ("birth_city", "In which city was {name} born?", gold_person["birth_city"]),
                    ("year", "In what year was {name} born?", gold_person["year"]),
                    ("profession", "What is the profession of {name}?", gold_person["profession"]),
                    ("subject", "What subject did {name} study at university?", gold_person["subject"]),
                    ("work", "What is the title of {name}'s best-known work?", gold_person["work"]),
                    ("home_city", "In which city did {name} settle?", gold_person["home_city"]),
                ]
            )
            question = "Question: " + q.format(name=gold_person["name"])
            gold = [_bio(gold_person)]
        else:
            org = world.org(gold_person["name"])
            kind, q, answer = rng.choice(
                [
                    ("birth_city", "In which city was the founder of {org} born?", gold_person["birth_city"]),
                    ("year", "In what year was the founder of {org} born?", gold_person["year"]),
                    (
                        "profession",
                        "What is the profession of the person who founded {org}?",
                        gold_person["profession"],
                    ),
                    (
                        "subject",
                        "What subject did the founder of {org} study at university?",
                        gold_person["subject"],
                    ),
                ]
            )
            question = "Question: " + q.format(org=org["name"])
            gold = [_org_doc(org), _bio(gold_person)]
        gold_fracs = [rng.random() for _ in gold]
        distractors: list[str] = []

        def build(n: int) -> Built:
            while len(distractors) < n:  # other people (and, for qa_2, their organisations), prefix-stable
                other = world.person()
                if hops == 2 and rng.random() < 0.5:
                    distractors.append(_org_doc(world.org(other["name"])))
                else:
                    distractors.append(_bio(other))
            docs = list(distractors[:n])
            slots = sorted(((round(f * n), k) for k, f in enumerate(gold_fracs)), reverse=True)
            for pos, k in slots:
                docs.insert(pos, gold[k])
            numbers = [docs.index(g) + 1 for g in gold]
            body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
            return Built(
                context=_QA_INTRO + body + _QA_OUTRO,
                metadata={
                    "gold_documents": numbers,
                    "num_documents": len(docs),
                    "haystack_span": [len(_QA_INTRO), len(_QA_INTRO) + len(body)],
                },
            )

        return Plan(
            build=build,
            question=question,
            answer_prefix=" Answer:",
            answers=[answer],
            lo=0,
            metadata={
                "haystack": "documents",
                "haystack_source": "synthetic",
                "hops": hops,
                "question_type": kind,
            },
        )

    return run(task, tokenizer, length, num_samples, seed, plan, max_new_tokens)


@register_task("qa_1", metric="string_match_part")
def qa_1(
    tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0, *, max_new_tokens: int = 32
) -> list[Sample]:
    """RULER ``qa_1`` (Hsieh et al. 2024), single-hop QA: one gold biography among distractor
    biographies of other invented people, each ``"Document {i}:\\n{doc}"``, shuffled."""
    return _qa("qa_1", 1, tokenizer, length, num_samples, seed, max_new_tokens)


@register_task("qa_2", metric="string_match_part")
def qa_2(
    tokenizer: Tokenizer, length: int, num_samples: int = 1, seed: int = 0, *, max_new_tokens: int = 32
) -> list[Sample]:
    """RULER ``qa_2`` (Hsieh et al. 2024), two-hop QA: the question names an organisation, its document
    names the founder, and the founder's biography holds the answer; distractors are other people and
    organisations."""
    return _qa("qa_2", 2, tokenizer, length, num_samples, seed, max_new_tokens)
