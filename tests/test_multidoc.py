"""Multi-document QA tasks (longlab.tasks.multidoc): exact answers where they should be, sizes, JSONL."""

from __future__ import annotations

import json

import pytest

from longlab.tasks import generate_samples, load_multidoc_jsonl, metric_for, score


@pytest.mark.parametrize("task", ["multidoc_qa_1", "multidoc_qa_2"])
def test_multidoc_samples(tokenizer, task):
    samples = generate_samples(task, tokenizer, 3000, 3, 7, num_docs=6)
    again = generate_samples(task, tokenizer, 3000, 3, 7, num_docs=6)
    assert [s.to_dict() for s in samples] == [s.to_dict() for s in again]  # seeded
    assert metric_for(task) == "string_match_all"
    for s in samples:
        docs = s.metadata["documents"]
        assert len(docs) == 6
        assert s.context == "".join(d.rstrip() + "\n\n" for d in docs)
        n = len(tokenizer(s.context + s.question, add_special_tokens=False)["input_ids"])
        assert n <= 3000
        answer = s.answers[0]
        holding = [i for i, d in enumerate(docs) if answer in d]
        assert holding == [s.metadata["gold_docs"][-1]]  # the answer sits in exactly one document
        for i in s.metadata["salient_docs"]:
            assert "URGENT NOTICE" in docs[i]
        assert score(task, f"It is {answer}.", s.answers) == 1.0


@pytest.mark.parametrize("task", ["multidoc_qa_1", "multidoc_qa_2"])
def test_sample_ids_name_the_length(tokenizer, task):
    """A grid over several lengths stores each length's samples under their own ids."""
    short, long = (generate_samples(task, tokenizer, n, 2, 0, num_docs=4) for n in (1500, 3000))
    ids = [s.sample_id for s in short + long]
    assert len(set(ids)) == 4 and ids[0] == f"{task}-1500-s0-0"


def test_two_hop_facts_are_in_different_documents(tokenizer):
    for s in generate_samples("multidoc_qa_2", tokenizer, 2400, 4, 1, num_docs=4):
        first, second = s.metadata["gold_docs"]
        assert first != second
        key = s.question.split("the ")[1].split(" archive")[0]
        docs = s.metadata["documents"]
        keeper = docs[first].split(f"The {key} archive is kept by ")[1].split(".")[0]
        assert f"{keeper} has badge number {s.answers[0]}." in docs[second]
        assert keeper not in s.answer_prefix


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="num_docs"):
        generate_samples("multidoc_qa_1", tokenizer, 3000, 1, 0, num_docs=1)
    with pytest.raises(ValueError, match="doc_tokens"):
        generate_samples("multidoc_qa_1", tokenizer, 200, 1, 0, num_docs=16)


def test_jsonl_round_trip_and_errors(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {
            "documents": ["Paris is in France.", "Rome is in Italy."],
            "question": "Where is Rome?",
            "answers": ["Italy"],
        },
        {"documents": ["A b c."], "question": "q?", "answers": "c", "answer_prefix": "Answer:"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    samples = load_multidoc_jsonl(path)
    assert samples[0].metadata["documents"] == rows[0]["documents"]
    assert samples[0].context == "Paris is in France.\n\nRome is in Italy.\n\n"
    assert samples[1].answers == ["c"] and samples[1].answer_prefix == "Answer:"
    for bad, match in (
        ('{"documents": [], "question": "q", "answers": ["a"]}', "documents"),
        ('{"documents": ["x"], "answers": ["a"]}', "question"),
        ("not json", "not JSON"),
    ):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=match):
            load_multidoc_jsonl(path)
