"""A corpus whose long-range dependencies are known, and a loader for a user's own text folder.

EntropyLong (Jia et al., arXiv 2510.02330) keeps a retrieved chunk only if it lowers the model's entropy
at a document's uncertain positions. Whether the kept chunks are the *right* ones cannot be checked on web
text; here it can. :func:`generate_corpus` invents entity **cards** (a name and six attributes with invented
values, each value unique in the corpus) and **documents** of neutral prose that mention a few entities
and later use one of their attributes without restating the card::

    card:      Record of Varnok Telliby. Varnok Telliby was born in the town of Quostrel. ...
    document:  ... Years later, Varnok Telliby went back to the town of Quostrel. ...
                                                                     ^ dependent value (char span kept)

so the true source card of every dependent position is known (``Dependency``). The retrieval pool of a
generated corpus is its cards only: documents share the built-in essay's sentences, which would otherwise
"explain" each other's prose.

:func:`load_corpus` reads either such a folder (written by :func:`write_corpus`, checked against its
manifest's SHA-256) or a user's folder of ``.txt`` files (one document each) and ``.jsonl`` files (one
object per line with a ``"text"`` field and an optional ``"id"``); every size is bounded before reading.
"""

from __future__ import annotations

import hashlib
import json
import random
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LonglabError, check_range, shorten
from ..safeio import file_sha256, publish_dir, read_user_file

__all__ = [
    "Doc",
    "Dependency",
    "Corpus",
    "ATTRIBUTES",
    "generate_corpus",
    "write_corpus",
    "load_corpus",
    "GROUNDTRUTH_FORMAT",
    "owns_groundtruth_dir",
    "MAX_FILES",
    "MAX_TOTAL_BYTES",
]

GROUNDTRUTH_FORMAT = "longlab-groundtruth"
MAX_DOCS = 100_000
MAX_CARDS = 1_000_000
MAX_FILES = 100_000  # files of a user's corpus folder
MAX_FILE_BYTES = 64 << 20
MAX_TOTAL_BYTES = 1 << 30  # a user's corpus, all files together
MAX_DOC_CHARS = 4 << 20

# attribute -> (card sentence, document sentence ending right before the value). {n}: the entity's name.
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "town": ("{n} was born in the town of {v}.", "Years later, {n} went back to the town of {v}."),
    "pet": ("{n} keeps a pet called {v}.", "Every evening {n} walked the pet called {v}."),
    "mentor": ("The mentor of {n} was a teacher named {v}.",
               "On the first day, {n} thanked the teacher named {v}."),
    "boat": ("{n} sails a boat named the {v}.", "In spring {n} repainted the boat named the {v}."),
    "code": ("The locker code of {n} is {v}.", "At the station, {n} opened the locker with the code {v}."),
    "street": ("{n} lives on {v} Street.", "After the market, {n} walked home to {v} Street."),
}
_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kl", "l", "m", "n", "p", "qu", "r", "s", "st", "t",
           "th", "v", "z", "sh", "h", "j")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ei")
_CODAS = ("", "n", "r", "l", "s", "th", "x", "m", "nd", "rk")


@dataclass(frozen=True)
class Doc:
    """One text of a corpus. ``id``: unique in the corpus (a generated id, or a file's relative path)."""

    id: str
    text: str


@dataclass(frozen=True)
class Dependency:
    """A dependent span of a document: ``text[start:end] == value``, true source ``card`` (its id)."""

    card: str
    attribute: str
    value: str
    start: int
    end: int


@dataclass
class Corpus:
    """Documents to extend, the retrieval pool, and (generated corpora) the truth per document id."""

    documents: list[Doc]
    pool: list[Doc]
    truth: dict[str, list[Dependency]] | None = None
    source: str = ""
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # card id -> {"entity", "attributes"}


# ------------------------------------------------------------------------------------------ generation


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _unique(rng: random.Random, used: set[str], make) -> str:
    for _ in range(1000):
        value = make()
        if value not in used and value.lower() not in used:
            used.add(value)
            used.add(value.lower())
            return value
    raise LonglabError("could not invent enough unique names; lower --cards")


def generate_corpus(
    docs: int, cards: int, *, seed: int = 0, refs_per_doc: int = 2, uses_per_ref: int = 2,
    filler_sentences: int = 3,
) -> Corpus:
    """``docs`` documents and ``cards`` entity cards with a known source card for every dependent value.

    Each document names ``refs_per_doc`` distinct entities (cards drawn at random) and uses
    ``uses_per_ref`` distinct attributes of each, once, between runs of ``filler_sentences`` essay
    sentences (so two dependent values are more than 32 tokens apart). A value never appears in a
    document before its dependent span, and every value is unique in the corpus (its card is the only
    text that holds it). Seeded: the same arguments give the same corpus."""
    check_range("docs", docs, 1, MAX_DOCS, integer=True)
    check_range("cards", cards, 1, MAX_CARDS, integer=True)
    check_range("seed", seed, 0, 2**32 - 1, integer=True)
    check_range("refs_per_doc", refs_per_doc, 1, 16, integer=True)
    check_range("uses_per_ref", uses_per_ref, 1, len(ATTRIBUTES), integer=True)
    check_range("filler_sentences", filler_sentences, 1, 32, integer=True)
    if refs_per_doc > cards:
        raise LonglabError(f"cards must be >= refs_per_doc ({refs_per_doc}) so a document names distinct "
                           f"entities, got {cards}")
    from ..tasks.haystacks import essay_sentences

    sentences = essay_sentences("builtin")[1]
    rng = random.Random(f"longlab.groundtruth/{seed}")
    used: set[str] = set()
    card_docs: list[Doc] = []
    card_info: dict[str, dict[str, Any]] = {}
    for i in range(cards):
        first = _unique(rng, used, lambda: _word(rng, 2).title())
        name = f"{first} {_unique(rng, used, lambda: _word(rng, 3).title())}"
        values = {}
        for attr in ATTRIBUTES:
            if attr == "code":
                values[attr] = _unique(rng, used, lambda: str(rng.randrange(10_000, 100_000)))
            else:
                values[attr] = _unique(rng, used, lambda: _word(rng, 3).title())
        order = list(ATTRIBUTES)
        rng.shuffle(order)
        text = " ".join([f"Record of {name}."] + [ATTRIBUTES[a][0].format(n=name, v=values[a])
                                                  for a in order])
        cid = f"card-{i:06d}"
        card_docs.append(Doc(cid, text))
        card_info[cid] = {"entity": name, "attributes": values}
    documents: list[Doc] = []
    truth: dict[str, list[Dependency]] = {}
    for d in range(docs):
        chosen = rng.sample(range(cards), refs_per_doc)
        uses = [(c, a) for c in chosen for a in rng.sample(list(ATTRIBUTES), uses_per_ref)]
        rng.shuffle(uses)
        parts: list[str] = [rng.choice(sentences) for _ in range(filler_sentences)]
        deps: list[Dependency] = []
        for c, attr in uses:
            cid = card_docs[c].id
            name, value = card_info[cid]["entity"], card_info[cid]["attributes"][attr]
            sentence = ATTRIBUTES[attr][1].format(n=name, v=value)
            start = sum(len(p) + 1 for p in parts) + sentence.index(value)  # parts joined by one space
            deps.append(Dependency(cid, attr, value, start, start + len(value)))
            parts.append(sentence)
            parts += [rng.choice(sentences) for _ in range(filler_sentences)]
        did = f"doc-{d:06d}"
        documents.append(Doc(did, " ".join(parts)))
        truth[did] = deps
    return Corpus(documents, card_docs, truth, source=f"generated:docs={docs},cards={cards},seed={seed}",
                  cards=card_info)


# ------------------------------------------------------------------------------------------ on disk


def owns_groundtruth_dir(path: Path) -> bool:
    names = {p.name for p in path.iterdir()}
    if not names <= {"manifest.json", "cards.jsonl", "docs.jsonl"} or "manifest.json" not in names:
        return False
    try:
        return json.loads((path / "manifest.json").read_text()).get("format") == GROUNDTRUTH_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def write_corpus(corpus: Corpus, out: str | Path, flag: str = "--out") -> Path:
    """Write a generated corpus to the folder ``out`` (``cards.jsonl``, ``docs.jsonl`` with each
    document's truth, ``manifest.json`` with both files' SHA-256), atomically; a folder longlab did not
    write is never replaced."""
    if corpus.truth is None:
        raise LonglabError("write_corpus writes generated corpora (with their truth) only")

    def write(tmp: Path) -> None:
        with open(tmp / "cards.jsonl", "w", encoding="utf-8") as fh:
            for card in corpus.pool:
                info = corpus.cards.get(card.id, {})
                fh.write(json.dumps({"id": card.id, "text": card.text, **info}) + "\n")
        with open(tmp / "docs.jsonl", "w", encoding="utf-8") as fh:
            for doc in corpus.documents:
                deps = [vars(d) for d in corpus.truth[doc.id]]
                fh.write(json.dumps({"id": doc.id, "text": doc.text, "truth": deps}) + "\n")
        manifest = {
            "format": GROUNDTRUTH_FORMAT, "version": 1, "source": corpus.source,
            "docs": len(corpus.documents), "cards": len(corpus.pool),
            "files": {n: {"sha256": file_sha256(tmp / n), "bytes": (tmp / n).stat().st_size}
                      for n in ("cards.jsonl", "docs.jsonl")},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    return publish_dir(out, write, flag, owned=owns_groundtruth_dir, last="manifest.json",
                       what="ground-truth corpus")


def _jsonl_records(data: bytes, where: str, flag: str) -> list[tuple[int, dict[str, Any]]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise LonglabError(f"{flag}: {where} is not UTF-8 text (byte {err.start})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except (ValueError, RecursionError):
            raise LonglabError(f"{flag}: {where} line {n} is not JSON") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise LonglabError(f"{flag}: {where} line {n}: expected an object with a \"text\" string")
        if "id" in obj and not isinstance(obj["id"], (str, int)):
            raise LonglabError(f"{flag}: {where} line {n}: \"id\" must be a string or an integer")
        if len(obj["text"]) > MAX_DOC_CHARS:
            raise LonglabError(f"{flag}: {where} line {n}: text longer than {MAX_DOC_CHARS:,} characters")
        out.append((n, obj))
    return out


def _load_groundtruth(root: Path, flag: str) -> Corpus:
    manifest = json.loads(read_user_file(root / "manifest.json", flag, 1 << 20).decode("utf-8"))
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise LonglabError(f"{flag}: {root}/manifest.json has no file list")
    data = {}
    for name in ("cards.jsonl", "docs.jsonl"):
        rec = files.get(name)
        if not isinstance(rec, dict):
            raise LonglabError(f"{flag}: {root}/manifest.json does not record {name}")
        blob = read_user_file(root / name, flag, MAX_TOTAL_BYTES)
        if hashlib.sha256(blob).hexdigest() != rec.get("sha256"):
            raise LonglabError(f"{flag}: {root / name} does not match its manifest (edited or truncated)")
        data[name] = _jsonl_records(blob, str(root / name), flag)
    pool = [Doc(str(o["id"]), o["text"]) for _, o in data["cards.jsonl"]]
    cards = {str(o["id"]): {"entity": o.get("entity"), "attributes": o.get("attributes")}
             for _, o in data["cards.jsonl"]}
    documents, truth = [], {}
    for n, o in data["docs.jsonl"]:
        did = str(o["id"])
        documents.append(Doc(did, o["text"]))
        try:
            truth[did] = [Dependency(**d) for d in o.get("truth", [])]
        except TypeError:
            raise LonglabError(f"{flag}: {root}/docs.jsonl line {n}: malformed truth") from None
    if not documents or not pool:
        raise LonglabError(f"{flag}: {root} holds no documents or no cards (empty corpus)")
    return Corpus(documents, pool, truth, source=str(manifest.get("source", root)), cards=cards)


def load_corpus(path: str | Path, flag: str = "--corpus", *, max_files: int = MAX_FILES,
                max_total_bytes: int = MAX_TOTAL_BYTES) -> Corpus:
    """The corpus in folder ``path``: a ground-truth folder written by :func:`write_corpus` (documents to
    extend = its documents, pool = its cards), else every ``.txt`` (one document) and ``.jsonl`` (one
    document per line: ``{"text": ..., "id": ...}``) file below it, sorted by path, documents = pool.
    Refused with a :class:`LonglabError` naming ``flag``: a missing path, a file, more than ``max_files``
    files or ``max_total_bytes`` bytes, an unreadable or malformed file, an empty corpus."""
    root = Path(path)
    try:
        mode = root.stat().st_mode
    except FileNotFoundError:
        raise LonglabError(f"{flag}: no such directory: {shorten(str(root))}") from None
    except OSError as exc:
        raise LonglabError(f"{flag}: cannot read {shorten(str(root))}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(mode):
        raise LonglabError(
            f"{flag}: {shorten(str(root))} is not a directory; give a folder of .txt/.jsonl files"
        )
    if (root / "manifest.json").is_file():
        try:
            manifest = json.loads(read_user_file(root / "manifest.json", flag, 1 << 20).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            manifest = None
        if isinstance(manifest, dict) and manifest.get("format") == GROUNDTRUTH_FORMAT:
            return _load_groundtruth(root, flag)
    files: list[Path] = []
    total = 0
    for p in sorted(root.rglob("*")):
        if p.suffix.lower() not in (".txt", ".jsonl") or p.is_symlink() or not p.is_file():
            continue
        files.append(p)
        if len(files) > max_files:
            raise LonglabError(
                f"{flag}: {shorten(str(root))} holds more than {max_files:,} .txt/.jsonl files"
            )
        total += p.stat().st_size
        if total > max_total_bytes:
            raise LonglabError(
                f"{flag}: {shorten(str(root))} holds more than {max_total_bytes:,} bytes of text"
            )
    if not files:
        raise LonglabError(f"{flag}: {shorten(str(root))} holds no .txt or .jsonl files (empty corpus)")
    docs: list[Doc] = []
    seen: set[str] = set()
    for p in files:
        rel = p.relative_to(root).as_posix()
        blob = read_user_file(p, flag, MAX_FILE_BYTES)
        if p.suffix.lower() == ".txt":
            try:
                text = blob.decode("utf-8-sig")
            except UnicodeDecodeError as err:
                raise LonglabError(f"{flag}: {rel} is not UTF-8 text (byte {err.start})") from None
            if "\x00" in text:
                raise LonglabError(f"{flag}: {rel} looks binary (NUL characters)")
            items = [(rel, text)]
        else:
            items = [(f"{rel}:{o.get('id', n)}", o["text"]) for n, o in _jsonl_records(blob, rel, flag)]
        for did, text in items:
            if not text.strip():
                continue
            if did in seen:
                raise LonglabError(f"{flag}: document id {shorten(did)} appears twice")
            seen.add(did)
            docs.append(Doc(did, text))
    if not docs:
        raise LonglabError(f"{flag}: {shorten(str(root))}: every file is empty (empty corpus)")
    return Corpus(docs, docs, None, source=f"folder:{root}")
