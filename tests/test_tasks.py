"""longlab.tasks: RULER-style generators (Hsieh et al. 2024), loaders and scorers."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import pytest

from longlab.tasks import (
    DEPTHS,
    TASKS,
    Sample,
    essay_sentences,
    exact_match,
    first_int_match,
    generate_samples,
    get_task,
    load_hf_dataset,
    load_jsonl,
    metric_for,
    niah_grid,
    rouge_l,
    save_jsonl,
    score,
    string_match_all,
    string_match_part,
    token_f1,
)
from longlab.tasks.haystacks import fit_units, join_with_inserts, split_sentences

RULER_13 = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
]


class WhitespaceTokenizer:
    """Test double: one token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]


class CharTokenizer:
    """Test double: one token per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


WS = WhitespaceTokenizer()
CHAR = CharTokenizer()


def n_tokens(tok, sample: Sample) -> int:
    return len(tok.encode(sample.context)) + len(tok.encode(sample.question))


def haystack(sample: Sample) -> str:
    start, end = sample.metadata["haystack_span"]
    return sample.context[start:end]


# --------------------------------------------------------------------------- registry


#: tasks whose questions share one document (HGMem builds one memory per document): several samples per
#: context by design, so the one-question-per-context checks below skip them (tests/test_memory_hgmem.py
#: checks their sizes, determinism and answers)
SHARED_DOCUMENT = {"longdoc_multihop"}
ONE_QUESTION = [t for t in TASKS if t not in SHARED_DOCUMENT]


def test_registry_names():
    assert list(TASKS)[:13] == RULER_13
    assert set(TASKS) == set(RULER_13) | {"passkey", "multidoc_qa_1", "multidoc_qa_2", "summ_events"} | {
        "redundant_niah", "redundant_niah_2hop", "cite_qa", "lookup_chain",  # longlab.tasks.compression
        "lookup_chain_reason",
    } | SHARED_DOCUMENT
    assert get_task("vt") is TASKS["vt"]


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="niah_single_1.*qa_2"):
        get_task("niah_single_9")
    with pytest.raises(ValueError, match="unknown task"):
        generate_samples("nope", WS, 1000)


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("task", ONE_QUESTION)
@pytest.mark.parametrize(
    ("tok", "length"), [(WS, 700), (WS, 3000), (CHAR, 6000)], ids=["ws700", "ws3000", "char6000"]
)
def test_length_within_budget(task, tok, length):
    samples = generate_samples(task, tok, length, num_samples=3, seed=1)
    assert len(samples) == 3
    for s in samples:
        total = n_tokens(tok, s)
        assert 0.8 * length < total <= length, (task, total)
        assert s.metadata["context_tokens"] + s.metadata["question_tokens"] == total
        assert s.task == task and s.length == length and s.answers and s.max_new_tokens > 0
        assert s.context and s.question
        # a worked answer (lookup_chain_reason: steps, then "Answer: N") starts without a prefix
        assert s.answer_prefix or task == "lookup_chain_reason"


def test_cwe_switches_frequencies_at_4k():
    short = generate_samples("cwe", WS, 3000, 1, 0)[0].metadata
    long = generate_samples("cwe", WS, 5000, 1, 0)[0].metadata
    assert (short["freq_cw"], short["freq_ucw"]) == (6, 1)
    assert (long["freq_cw"], long["freq_ucw"]) == (30, 3)


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("task", ONE_QUESTION)
def test_deterministic_and_seed_dependent(task):
    a = [s.to_dict() for s in generate_samples(task, WS, 1500, 2, seed=7)]
    b = [s.to_dict() for s in generate_samples(task, WS, 1500, 2, seed=7)]
    c = [s.to_dict() for s in generate_samples(task, WS, 1500, 2, seed=8)]
    assert a == b
    assert [x["context"] for x in a] != [x["context"] for x in c]
    assert a[0]["context"] != a[1]["context"]  # samples differ within a run
    assert len({x["sample_id"] for x in a + c}) == 4


def test_sample_prefix_stable():
    """Sample i does not depend on how many samples were asked for."""
    few = generate_samples("niah_multikey_2", WS, 1200, 2, seed=3)
    many = generate_samples("niah_multikey_2", WS, 1200, 5, seed=3)
    assert [s.to_dict() for s in few] == [s.to_dict() for s in many[:2]]


# --------------------------------------------------------------------------- answers in context

NEEDLE = re.compile(r"One of the special magic (numbers|uuids|words) for (\S+) is: (\S+)\.")


@pytest.mark.parametrize("task", [t for t in RULER_13 if t.startswith("niah")])
def test_niah_needles_hold_the_answers(task):
    for s in generate_samples(task, WS, 2000, 3, seed=2):
        found: dict[str, list[str]] = {}
        for _, key, value in NEEDLE.findall(s.context):
            found.setdefault(key, []).append(value)
        expected = [v for k in s.metadata["query_keys"] for v in found[k]]
        assert sorted(expected) == sorted(s.answers)
        for k in s.metadata["query_keys"]:
            assert k in s.question and k in s.answer_prefix
        assert all(a in haystack(s) for a in s.answers)
        if s.metadata["haystack"] == "needle":  # the haystack is made of distractor needles
            assert len(found) > 10 and all(len(v) == 1 for v in found.values())
        else:
            assert len(found) == s.metadata["num_keys"]
        for off, needle in zip(s.metadata["needle_offsets"], s.metadata["needles"]):
            assert s.context[off : off + len(needle)] == needle


def test_niah_templates_singular_and_plural():
    single = generate_samples("niah_single_2", WS, 1000, 1, 0)[0]
    assert single.context.startswith("A special magic number is hidden within the following text.")
    assert single.question.startswith("What is the special magic number for ")
    assert single.answer_prefix.endswith("mentioned in the provided text is")
    multi = generate_samples("niah_multivalue", WS, 1000, 1, 0)[0]
    assert multi.context.startswith("Some special magic numbers are hidden within the following text.")
    assert multi.question.startswith("What are all the special magic numbers for ")
    assert len(multi.answers) == 4
    uu = generate_samples("niah_single_3", WS, 1000, 1, 0)[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uu.answers[0])
    num = generate_samples("niah_single_1", WS, 1000, 1, 0)[0]
    assert re.fullmatch(r"\d{7}", num.answers[0])
    assert re.fullmatch(r"[a-z]+-[a-z]+", num.metadata["keys"][0])
    assert "The grass is green. The sky is blue." in num.context


def test_niah_depths_come_from_rulers_grid():
    for s in generate_samples("niah_multikey_1", WS, 2000, 3, 0):
        depths = s.metadata["needle_depths"]
        assert len(set(depths)) == 4 and all(d in DEPTHS for d in depths) and s.depth is None


def test_vt_chain_resolves_to_answers():
    assign = re.compile(r"VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|(\d+))")
    for s in generate_samples("vt", WS, 2500, 3, seed=4):
        value = s.metadata["value"]
        assert f"value {value}" in s.question
        lines = assign.findall(haystack(s))
        names: set[str] = set()
        for name, _, src, number in lines:  # in text order: a variable is defined before it is copied
            if number == str(value) or src in names:
                names.add(name)
        assert names == set(s.answers) and len(s.answers) == 5
        # the in-context example is solved and uses other names
        example = s.context[: s.metadata["haystack_span"][0]]
        assert example.count("Question: Find all variables") == 1
        assert not names & set(re.findall(r"VAR ([A-Z]{5})", example))


def test_cwe_answers_are_the_most_common_words():
    for length in (2000, 6000, 12000):  # 12k runs past the shipped word list (made-up words added)
        for s in generate_samples("cwe", WS, length, 2, seed=5):
            items = re.findall(r"\d+\. (\S+)", haystack(s))
            counts = Counter(items)
            top = {w for w, _ in counts.most_common(10)}
            assert top == set(s.answers)
            assert min(counts[a] for a in s.answers) > max(c for w, c in counts.items() if w not in top)
            assert len(items) == s.metadata["num_words"]
            example = s.context[: s.metadata["haystack_span"][0]]
            assert not set(re.findall(r"\d+\. (\S+)", example)) & set(items)


def test_fwe_answers_are_the_most_frequent_words():
    for s in generate_samples("fwe", WS, 3000, 2, seed=6):
        counts = Counter(haystack(s).split())
        assert counts.most_common(1)[0][0] == "...."
        del counts["...."]
        ranked = counts.most_common()
        assert {w for w, _ in ranked[:3]} == set(s.answers)
        assert ranked[2][1] > ranked[3][1]
        assert all(len(a) == 6 and a.isalpha() for a in s.answers)


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_gold_documents_hold_the_answer(task):
    for s in generate_samples(task, WS, 2500, 4, seed=8):
        docs = dict(re.findall(r"Document (\d+):\n(.*)", s.context))
        gold = [docs[str(i)] for i in s.metadata["gold_documents"]]
        assert len(docs) == s.metadata["num_documents"] > len(gold)
        assert s.answers[0] in gold[-1]
        if task == "qa_1":
            (bio,) = gold
            assert bio.split(" is ")[0] in s.question  # the question names the gold person
        else:
            org_doc, bio = gold
            org = re.search(r"(The \S+ \S+?)(?: born| study|\?)", s.question).group(1)
            assert org_doc.startswith(org)
            founder = re.search(r" by (.+?)\. It is based", org_doc).group(1)
            assert bio.startswith(founder)
            assert sum(d.startswith(founder + " is ") for d in docs.values()) == 1


def test_passkey():
    for s in generate_samples("passkey", WS, 1500, 3, seed=9):
        key = s.answers[0]
        assert 1 <= int(key) <= 50000
        assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.context
        assert s.question == "What is the pass key?" and s.answer_prefix == " The pass key is"
    fixed = generate_samples("passkey", WS, 1500, 1, 0, depth=0.5)[0]
    start, end = fixed.metadata["haystack_span"]
    assert abs((fixed.metadata["needle_offsets"][0] - start) / (end - start) - 0.5) < 0.05


# --------------------------------------------------------------------------- depth


def test_niah_grid_respects_depth():
    lengths, depths = [1000, 3000], [0.0, 0.25, 0.5, 0.75, 1.0]
    grid = niah_grid(WS, lengths, depths, num_samples=2, seed=0)
    assert len(grid) == len(lengths) * len(depths) * 2
    assert len({s.sample_id for s in grid}) == len(grid)
    for s in grid:
        assert s.task == "niah_grid" and s.depth in depths
        assert n_tokens(WS, s) <= s.length
        start, end = s.metadata["haystack_span"]
        rel = (s.metadata["needle_offsets"][0] - start) / (end - start)
        assert abs(rel - s.depth) < 0.05, (s.length, s.depth, rel)
        assert s.answers[0] in s.context


def test_niah_grid_classic_needle_and_noise():
    grid = niah_grid(CHAR, [3000], [0.3], needle="classic")
    (s,) = grid
    assert "eat a sandwich and sit in Dolores Park" in s.context
    assert score(s.task, "Eat a sandwich and sit in Dolores Park.", s.answers) == 1.0
    noise = niah_grid(WS, [800], [0.6], haystack="noise")[0]
    start, end = noise.metadata["haystack_span"]
    assert abs((noise.metadata["needle_offsets"][0] - start) / (end - start) - 0.6) < 0.08


def test_single_needle_depth_option():
    for depth in (0.1, 0.9):
        s = generate_samples("niah_single_2", WS, 4000, 1, 0, depth=depth)[0]
        start, end = s.metadata["haystack_span"]
        assert s.depth == depth
        assert abs((s.metadata["needle_offsets"][0] - start) / (end - start) - depth) < 0.03


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"length": 0}, "length"),
        ({"length": 2.5}, "length"),
        ({"length": 40}, "length"),  # leaves no room for the question
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": "3"}, "num_samples"),
        ({"seed": 1.5}, "seed"),
        ({"depth": 1.5}, "depth"),
    ],
)
def test_bad_arguments(kwargs, name):
    args = {"tokenizer": WS, "length": 1000, "num_samples": 1, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=name):
        generate_samples("niah_single_1", **args)


def test_too_short_names_minimum():
    with pytest.raises(ValueError, match=r"length=100 .*at least \d+ tokens.*\[\d+, inf\)"):
        generate_samples("cwe", WS, 100)


def test_bad_task_options():
    with pytest.raises(ValueError, match="freq_ucw"):
        generate_samples("cwe", WS, 2000, freq_cw=3, freq_ucw=3)
    with pytest.raises(ValueError, match="lengths"):
        niah_grid(WS, [], [0.5])
    with pytest.raises(ValueError, match="depths"):
        niah_grid(WS, [1000], [-0.1])
    with pytest.raises(ValueError, match="needle"):
        niah_grid(WS, [1000], [0.5], needle="other")
    with pytest.raises(TypeError, match="tokenizer"):
        generate_samples("vt", object(), 1000)
    with pytest.raises(ValueError, match="essay_source"):
        generate_samples("niah_single_2", WS, 1000, essay_source="/no/such/file.txt")


# --------------------------------------------------------------------------- haystack helpers


def test_builtin_essay():
    label, sentences = essay_sentences("builtin")
    assert label.startswith("builtin") and len(sentences) > 100
    assert not any(ch.isdigit() for s in sentences for ch in s)
    assert all(s[-1] in ".!?\"'" for s in sentences)


def test_essay_from_file(tmp_path):
    text = "Title\n\n" + " ".join(f"Sentence number {w} is here." for w in "abcdefghijkl")
    path = tmp_path / "prose.txt"
    path.write_text(text)
    label, sentences = essay_sentences(str(path))
    assert label == "file:prose.txt" and len(sentences) == 12
    s = generate_samples("niah_single_2", WS, 500, 1, 0, essay_source=str(path))[0]
    assert s.metadata["haystack_source"] == "file:prose.txt" and "Sentence number" in s.context


def test_essay_from_local_nltk_gutenberg(tmp_path, monkeypatch):
    """NLTK's Gutenberg corpus is used only when already on disk (read without importing nltk)."""
    import zipfile

    corpora = tmp_path / "corpora"
    corpora.mkdir()
    prose = "CHAPTER I\n\n" + "\n\n".join(
        f"Emma walked to the {w} and back\nagain slowly." for w in "abcdefghijkl"
    )
    with zipfile.ZipFile(corpora / "gutenberg.zip", "w") as zf:
        zf.writestr("gutenberg/austen-emma.txt", prose)
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))
    essay_sentences.cache_clear()
    try:
        label, sentences = essay_sentences("nltk")
        assert label == "nltk:gutenberg" and len(sentences) == 12
        assert sentences[0] == "Emma walked to the a and back again slowly."
    finally:
        essay_sentences.cache_clear()


def test_split_sentences_drops_headings_and_digits():
    text = "On Things\n\nOne good sentence here. Another in 1999 here. Third one is fine!"
    assert split_sentences(text) == ["One good sentence here.", "Third one is fine!"]


def test_join_with_inserts_offsets():
    text, offsets = join_with_inserts(["aa", "bb", "cc", "dd"], [(0.5, "X"), (0.0, "Y"), (1.0, "Z")], " ")
    assert text == "Y aa bb X cc dd Z"
    assert [text[o] for o in offsets] == ["X", "Y", "Z"]


def test_fit_units_finds_largest_fit():
    def measure(n):
        return 10 + 7 * n + (n // 5)

    for budget in (10, 11, 100, 1000, 12345):
        n = fit_units(measure, budget, lo=0)
        assert measure(n) <= budget < measure(n + 1)
    n = fit_units(measure, 1000, lo=0, guess=200, slack=20)
    assert 1000 - 20 <= measure(n) <= 1000


# --------------------------------------------------------------------------- JSONL


def test_jsonl_round_trip(tmp_path):
    samples = generate_samples("niah_multivalue", WS, 800, 2, 0) + generate_samples("vt", WS, 800, 1, 0)
    path = tmp_path / "sub" / "s.jsonl"
    save_jsonl(samples, path)
    loaded = load_jsonl(path)
    assert [s.to_dict() for s in loaded] == [s.to_dict() for s in samples]
    assert loaded == samples
    assert Sample.from_dict(json.loads(json.dumps(samples[0].to_dict()))) == samples[0]


def test_load_jsonl_aliases_and_defaults(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"context": "c1", "question": "q1", "answer": "a1", "extra": 3},
        {"context": "c2", "question": "q2", "answers": "a2", "max_new_tokens": 5, "depth": 0.5},
        {"context": "c3", "question": "q3", "answers": ["x", 7], "task": "qa_1"},
        {"context": "c4", "question": "q4", "answers": {"text": ["y", "z"], "answer_start": [0, 3]}},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    with path.open("a") as fh:
        fh.write(json.dumps(rows[3]) + "\n")
    a, b, c, d = load_jsonl(path)
    assert d.answers == ["y", "z"]
    assert a.answers == ["a1"] and a.metadata == {"extra": 3} and a.sample_id == "mine-1"
    assert a.answer_prefix == "" and a.max_new_tokens > 0
    assert b.answers == ["a2"] and b.max_new_tokens == 5 and b.depth == 0.5
    assert c.answers == ["x", "7"] and c.task == "qa_1" and c.sample_id == "mine-4"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"context": "c", "question": "q"', r":2: malformed JSON"),
        ('{"context": "c", "answers": ["a"]}', r":2: missing required key\(s\): question"),
        ('{"context": "c", "question": "q"}', r":2: .*answers"),
        ('{"context": "c", "question": "q", "answers": [["a"]]}', r":2: 'answers'"),
        ('{"context": "c", "question": "q", "answers": "a", "max_new_tokens": 0}', r":2: 'max_new_tokens'"),
        ('["not", "an", "object"]', r":2: a sample must be a JSON object"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"context": "c", "question": "q", "answers": ["a"]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_jsonl(path)


def test_load_hf_dataset_local_only(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="path must be an existing local"):
        load_hf_dataset("someone/some-hub-dataset")
    path = tmp_path / "d.jsonl"
    save_jsonl(generate_samples("passkey", WS, 300, 2, 0), path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        load_hf_dataset(path)


class _FakeDatasets:
    """Stands in for the ``datasets`` module: records calls, returns plain lists and dicts."""

    class DatasetDict(dict):
        pass

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def load_from_disk(self, path):
        self.calls.append(("load_from_disk", path))
        return self.DatasetDict(test=self.rows, dev=self.rows[:1])

    def load_dataset(self, path, data_files=None):
        self.calls.append(("load_dataset", path, data_files))
        return self.DatasetDict(train=self.rows)


def test_load_hf_dataset_dispatch(tmp_path, monkeypatch):
    rows = [{"context": "c", "question": "q", "answer": "a", "length": 10}, {"context": "d", "question": "r"}]
    fake = _FakeDatasets(rows[:1])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text("{}")
    with pytest.raises(ValueError, match=r"split must be one of \['test', 'dev'\]"):
        load_hf_dataset(saved)
    (s,) = load_hf_dataset(saved, split="test")
    assert s.answers == ["a"] and s.length == 10 and s.sample_id == "saved-0"
    assert fake.calls[-1] == ("load_from_disk", str(saved))
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("")
    assert len(load_hf_dataset(data_file)) == 1  # the only split is taken
    assert fake.calls[-1] == ("load_dataset", "json", str(data_file))
    with pytest.raises(ValueError, match="path must be a folder or one of"):
        load_hf_dataset(_touch(tmp_path / "notes.txt"))
    fake.rows = rows
    with pytest.raises(ValueError, match=r"row 1: missing required key\(s\): answers"):
        load_hf_dataset(saved, split="test")


def _touch(path):
    path.write_text("")
    return path


@pytest.mark.slow
def test_load_hf_dataset_with_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    samples = generate_samples("passkey", WS, 300, 2, 0)
    rows = [{k: v for k, v in s.to_dict().items() if k != "metadata"} for s in samples]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    loaded = load_hf_dataset(tmp_path / "saved")
    assert [s.answers for s in loaded] == [s.answers for s in samples]
    datasets.DatasetDict({"test": ds, "dev": ds}).save_to_disk(str(tmp_path / "multi"))
    with pytest.raises(ValueError, match="split must be one of"):
        load_hf_dataset(tmp_path / "multi")
    assert len(load_hf_dataset(tmp_path / "multi", split="dev")) == 2


# --------------------------------------------------------------------------- scoring


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("the NUMBERS are 123", ["123", "456", "Numbers", "x"]) == 0.5
    assert string_match_all("nothing", "123") == 0.0


def test_string_match_part():
    assert string_match_part("Paris, France", ["paris", "London"]) == 1.0
    assert string_match_part("Rome", ["paris", "London"]) == 0.0


def test_exact_match_and_f1():
    assert exact_match("The Eiffel Tower!", ["eiffel tower"]) == 1.0
    assert exact_match("Eiffel Tower in Paris", ["eiffel tower"]) == 0.0
    # pred tokens: eiffel tower in paris (4); ref: eiffel tower (2); common 2 -> P=0.5, R=1, F1=2/3
    assert token_f1("the Eiffel Tower in Paris", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    assert token_f1("abc", ["xyz", "abc"]) == 1.0
    assert token_f1("", ["abc"]) == 0.0


def test_rouge_l():
    # LCS("a b c d", "a c d e") = "a c d" (3): P = R = 3/4 -> F = 0.75
    assert rouge_l("a b c d", ["a c d e"]) == pytest.approx(0.75)
    assert rouge_l("x y", ["a b", "x y"]) == pytest.approx(1.0)


def test_first_int_match():
    assert first_int_match(" 12345. The pass key is 12345", ["12345"]) == 1.0
    assert first_int_match("It is 1234 or 12345", ["12345"]) == 0.0
    assert first_int_match("no number", ["12345"]) == 0.0


def test_score_picks_rulers_metric():
    assert metric_for("qa_1") == metric_for("qa_2") == "string_match_part"
    assert {metric_for(t) for t in RULER_13 if not t.startswith("qa")} == {"string_match_all"}
    assert score("qa_2", "Paris", ["paris", "rome"]) == 1.0
    assert score("niah_multivalue", "1111111, 2222222", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert score("passkey", "42", ["42"]) == 1.0
    for t in TASKS:
        assert 0.0 <= score(t, "anything", ["a", "b"]) <= 1.0
    with pytest.raises(ValueError, match="refs"):
        string_match_all("x", [])


def test_generated_answers_score_one():
    for task in TASKS:
        s = generate_samples(task, WS, 1200, 1, 0)[0]
        assert score(task, " " + ", ".join(s.answers) + ".", s.answers) == 1.0
        assert score(task, "I do not know.", s.answers) == 0.0


# --------------------------------------------------------------------------- task registry and metrics


def _ruler_metric(task: str) -> str:
    """RULER's scoring rule (NVIDIA/RULER's synthetic-task eval constants) plus pass-key accuracy."""
    if task.startswith("qa_") or task in ("longdoc_multihop", "memory_jsonl"):  # memory QA (issue #31)
        return "string_match_part"
    if task == "summ_events":  # longlab's summarisation-like free-text task (longlab.tasks.summary)
        return "rouge_l"
    if task == "cite_qa":  # answer correctness and citation F1 (longlab.tasks.compression)
        return "answer_citation"
    if task == "lookup_chain_reason":  # the number a worked answer ends on (longlab.tasks.compression)
        return "final_number"
    return "first_int_match" if task == "passkey" else "string_match_all"


def test_every_registered_task_carries_rulers_metric():
    from longlab.tasks import DEFAULT_METRIC, TASK_REGISTRY

    assert set(RULER_13) | {"passkey", "niah_grid"} <= set(TASK_REGISTRY)
    for name, spec in TASK_REGISTRY.items():
        assert spec.metric == metric_for(name) == _ruler_metric(name), name
    assert TASK_REGISTRY["niah_grid"].kind == "grid" and "niah_grid" not in TASKS
    assert metric_for("my_unregistered_set") == DEFAULT_METRIC == "string_match_all"


def test_a_new_task_with_a_custom_metric_is_scored_by_it():
    from longlab.recipe import LonglabError
    from longlab.tasks import METRICS, TASK_REGISTRY, register_metric, register_task

    def last_word(pred: str, refs) -> float:  # 1.0 iff the prediction's last word is a reference
        words = pred.replace(".", " ").split()
        return float(bool(words) and words[-1] in refs)

    def tiny_task(tokenizer, length, num_samples=1, seed=0):
        return [Sample("the word is blue", "Which word?", answers=["blue"], task="tiny_task")]

    try:
        register_metric("last_word")(last_word)
        register_task("tiny_task", metric="last_word")(tiny_task)
        assert "tiny_task" in TASKS and metric_for("tiny_task") == "last_word"
        (s,) = generate_samples("tiny_task", WS, 100)
        # string_match_all would give 1.0 to the first prediction and 0.0 to the second
        assert score(s.task, "blue, not red", s.answers) == 0.0
        assert score(s.task, "It is blue.", s.answers) == 1.0
        with pytest.raises(LonglabError, match="already registered"):
            register_task("tiny_task", metric="exact_match")(tiny_task)
        with pytest.raises(LonglabError, match="metric must be one of"):
            register_task("other_task", metric="no_such_metric")
    finally:
        TASK_REGISTRY.pop("tiny_task", None)
        METRICS.pop("last_word", None)
    assert "tiny_task" not in TASKS


def test_a_file_task_declares_its_metric_per_line_or_by_name(tmp_path):
    from longlab.tasks import TASK_REGISTRY, declare_task, score_sample

    rows = [
        {"context": "c", "question": "q", "answers": ["Paris"], "task": "capitals", "metric": "exact_match"},
        {"context": "c", "question": "q", "answers": ["Paris"], "task": "capitals"},
    ]
    path = tmp_path / "capitals.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    declared, plain = load_jsonl(path)
    assert declared.metric == "exact_match" and plain.metric == "" and "metric" not in declared.metadata
    assert Sample.from_dict(declared.to_dict()) == declared and "metric" not in plain.to_dict()
    pred = "The capital is Paris"
    assert score_sample(declared, pred) == 0.0  # exact match, as the line declares
    assert score_sample(plain, pred) == 1.0  # default string_match_all
    try:
        declare_task("capitals", "exact_match")
        assert score_sample(plain, pred) == score("capitals", pred, ["Paris"]) == 0.0
        assert score_sample(plain, "paris") == 1.0
    finally:
        TASK_REGISTRY.pop("capitals", None)
    with pytest.raises(ValueError, match="'metric' must be one of"):
        Sample.from_dict({**rows[0], "metric": "bleu"})
