"""``dialogue_threads``: interleaved conversation threads whose slots are set and later revised (C-DIC, spec
§25), as token ids of a synthetic vocabulary with exact ground truth.

Vocabulary (:class:`Vocab`, 300 ids): ``PAD``, ``Q``, then topic, slot, value and filler words. Every turn has
``L = 4`` tokens:

- *open*    ``[topic, v0, v1, v2]``        opens a thread and sets its three slots (by position);
- *revise*  ``[topic, slot_k, v, filler]`` sets slot ``k`` of the thread to ``v`` ("make it Tuesday instead");
- *chatter* ``[topic, f, f, f]``           mentions the thread, changes nothing;
- *question* ``[Q, topic, slot_k, Q]``     asks the slot's *current* value (the answer, read at the last
  position; it is not part of the history).

A question's *distance* ``d`` is the number of turns since its slot was last set and its
*revisions* the number
of times the slot was set after the thread was opened (a revision always changes the value).
:func:`conversation` draws training conversations; :func:`probe` builds one whose last turn asks a chosen slot
with an exact ``d`` and number of revisions (for the accuracy-by-distance table).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..errors import LonglabError, check_range

__all__ = ["L", "N_SLOTS", "VOCAB", "Turn", "Vocab", "conversation", "probe", "replay"]

L = 4
N_SLOTS = 3


@dataclass(frozen=True)
class Vocab:
    n_topics: int = 64
    n_values: int = 100
    n_filler: int = 130

    PAD = 0
    Q = 1

    @property
    def topic0(self) -> int:
        return 2

    @property
    def slot0(self) -> int:
        return self.topic0 + self.n_topics

    @property
    def value0(self) -> int:
        return self.slot0 + N_SLOTS

    @property
    def filler0(self) -> int:
        return self.value0 + self.n_values

    @property
    def size(self) -> int:
        return self.filler0 + self.n_filler


VOCAB = Vocab()


@dataclass
class Turn:
    """One turn: ``tokens`` (``L`` ids), ``kind`` (open/revise/chatter/question), ``thread`` (index in the
    conversation), and for a question ``slot``, ``answer`` (token id), ``distance``, ``revisions``."""

    tokens: list[int]
    kind: str
    thread: int
    slot: int = -1
    answer: int = -1
    distance: int = -1
    revisions: int = -1
    meta: dict = field(default_factory=dict)


class _State:
    def __init__(self, rng: random.Random, vocab: Vocab, n_threads: int) -> None:
        self.rng, self.v = rng, vocab
        self.topics = rng.sample(range(vocab.n_topics), n_threads)
        self.values: dict[tuple[int, int], int] = {}
        self.last_set: dict[tuple[int, int], int] = {}
        self.revs: dict[tuple[int, int], int] = {}
        self.opened: list[int] = []
        self.turns: list[Turn] = []

    def filler(self) -> int:
        return self.v.filler0 + self.rng.randrange(self.v.n_filler)

    def value(self) -> int:
        return self.v.value0 + self.rng.randrange(self.v.n_values)

    def open(self, th: int) -> None:
        vals = [self.value() for _ in range(N_SLOTS)]
        t = len(self.turns)
        for s, val in enumerate(vals):
            self.values[th, s], self.last_set[th, s], self.revs[th, s] = val, t, 0
        self.opened.append(th)
        self.turns.append(Turn([self.v.topic0 + self.topics[th], *vals], "open", th))

    def revise(self, th: int, s: int) -> None:
        old = self.values[th, s]
        val = old
        while val == old:
            val = self.value()
        t = len(self.turns)
        self.values[th, s], self.last_set[th, s] = val, t
        self.revs[th, s] += 1
        self.turns.append(
            Turn(
                [self.v.topic0 + self.topics[th], self.v.slot0 + s, val, self.filler()], "revise", th, slot=s
            )
        )

    def chatter(self, th: int) -> None:
        toks = [self.v.topic0 + self.topics[th], self.filler(), self.filler(), self.filler()]
        self.turns.append(Turn(toks, "chatter", th))

    def question(self, th: int, s: int) -> None:
        t = len(self.turns)
        self.turns.append(
            Turn(
                [self.v.Q, self.v.topic0 + self.topics[th], self.v.slot0 + s, self.v.Q],
                "question",
                th,
                slot=s,
                answer=self.values[th, s],
                distance=t - self.last_set[th, s],
                revisions=self.revs[th, s],
            )
        )

    def background(self, avoid: tuple[int, int] | None, p_question: float = 0.3) -> None:
        """One random turn among the opened threads that neither sets nor asks ``avoid``."""
        while True:
            th = self.rng.choice(self.opened)
            s = self.rng.randrange(N_SLOTS)
            r = self.rng.random()
            if r < 0.35:
                if (th, s) != avoid:
                    return self.revise(th, s)
            elif r < 0.35 + p_question:
                if (th, s) != avoid:
                    return self.question(th, s)
            else:
                return self.chatter(th)


def conversation(
    rng: random.Random, n_turns: int, n_threads: int, vocab: Vocab = VOCAB, p_question: float = 0.35
) -> list[Turn]:
    """A training conversation: threads are opened over the first turns (each opened before it is used),
    then revise / chatter / question turns on random opened threads."""
    check_range("n_turns", n_turns, 1, 100_000, integer=True)
    check_range("n_threads", n_threads, 1, vocab.n_topics, integer=True)
    st = _State(rng, vocab, n_threads)
    for _ in range(n_turns):
        if len(st.opened) < n_threads and (not st.opened or rng.random() < 0.3):
            st.open(len(st.opened))
        else:
            st.background(None, p_question)
    return st.turns


def probe(
    rng: random.Random, distance: int, revisions: int, n_threads: int = 8, vocab: Vocab = VOCAB, gap: int = 4
) -> list[Turn]:
    """A conversation whose last turn asks slot ``(target, slot)`` set ``distance`` turns earlier and revised
    ``revisions`` times: the other threads open, ``gap`` background turns, the target opens, then
    ``revisions`` × (``gap`` background turns + a revision), ``distance - 1`` background turns that
    neither set
    nor ask the target slot, and the question. Its length depends only on the arguments."""
    check_range("distance", distance, 1, 10_000, integer=True)
    check_range("revisions", revisions, 0, 100, integer=True)
    check_range("n_threads", n_threads, 2, vocab.n_topics, integer=True)
    st = _State(rng, vocab, n_threads)
    target, slot = n_threads - 1, rng.randrange(N_SLOTS)
    for th in range(n_threads - 1):
        st.open(th)
    for _ in range(gap):
        st.background((target, slot))
    st.open(target)
    for _ in range(revisions):
        for _ in range(gap):
            st.background((target, slot))
        st.revise(target, slot)
    for _ in range(distance - 1):
        st.background((target, slot))
    st.question(target, slot)
    q = st.turns[-1]
    if q.distance != distance or q.revisions != revisions:  # the construction guarantees it
        raise LonglabError(f"dialogue_threads: probe built d={q.distance}, r={q.revisions}")
    return st.turns


def replay(turns: list[Turn], vocab: Vocab = VOCAB) -> list[int]:
    """Answers recomputed from the tokens alone (topic -> slot values, updated by open and revise turns):
    one per question, in order. The generator's stored answers must equal these."""
    values: dict[tuple[int, int], int] = {}
    out = []
    for t in turns:
        a, b, c, d = t.tokens
        if t.kind == "open":
            for s, v in enumerate((b, c, d)):
                values[a, s] = v
        elif t.kind == "revise":
            values[a, b - vocab.slot0] = c
        elif t.kind == "question":
            out.append(values[b, c - vocab.slot0])
    return out
