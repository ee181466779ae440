"""HGMem (issue #31): hypergraph incidence, the plan/retrieve/evolve/merge loop on a scripted backend, the
baselines' retrieval, the longdoc task and loader, and the runner's rows."""

from __future__ import annotations

import json
import re

import pytest
import torch

from longlab.errors import LonglabError
from longlab.memory import (
    BackendStats,
    DocumentIndex,
    HashEmbedder,
    HGMem,
    HGMemConfig,
    HypergraphMemory,
    KnowledgeGraph,
    VectorIndex,
    chunk_text,
)
from longlab.memory.hgmem import (
    EVOLVE_INSTRUCTION,
    EXTRACT_SCHEMA,
    MERGE_INSTRUCTION,
    PLAN_INSTRUCTION,
    V1_SAMPLE_VALUES,
    Trace,
    answer_messages,
    copies_instruction,
)
from longlab.memory.runner import parse_system, run_systems
from longlab.tasks.longdoc import load_memory_jsonl, longdoc_multihop


# ------------------------------------------------------------------------------------------ hypergraph
def test_insert_update_merge_keep_incidence_consistent():
    m = HypergraphMemory()
    a = m.insert(["alice", "Acme"], "Alice works at Acme", [1])
    b = m.insert(["ACME", "Paris"], "Acme is in Paris", [2])
    c = m.insert(["bob", "paris"], "Bob lives in Paris", [3])
    m.check()
    assert m.points_of("acme") == {a, b} and m.points_of("PARIS") == {b, c}
    assert m.insert(["Acme", "alice"], "Alice works at Acme") == a  # no duplicate
    m.update(c, "Bob moved to Rome", objects=["bob", "rome"], chunks=[4])
    m.check()
    assert m.points_of("paris") == {b} and m.points_of("rome") == {c}
    assert m.points[c].chunks == frozenset({3, 4})
    new = m.merge([a, b], "Alice works at Acme, which is in Paris")
    m.check()
    assert set(m.points) == {c, new} and new not in (a, b, c)
    assert m.points[new].objects == frozenset({"ALICE", "ACME", "PARIS"})
    assert m.points[new].chunks == frozenset({1, 2})
    assert m.points_of("acme") == {new} and m.points_of("alice") == {new}
    assert m.vertices() == {"ALICE", "ACME", "PARIS", "BOB", "ROME"}


def test_check_detects_a_broken_incidence_and_bad_operations_are_refused():
    m = HypergraphMemory()
    a = m.insert(["x", "y"], "d")
    m.incidence["Y"].discard(a)
    with pytest.raises(AssertionError):
        m.check()
    m = HypergraphMemory(max_points=1)
    a = m.insert(["x"], "d")
    with pytest.raises(LonglabError, match="two existing"):
        m.merge([a], "one point")
    with pytest.raises(LonglabError, match="two existing"):
        m.merge([a, 99], "missing")
    with pytest.raises(LonglabError, match="no memory point"):
        m.update(7, "x")
    with pytest.raises(LonglabError, match="full"):
        m.insert(["z"], "another")
    with pytest.raises(LonglabError, match="involved object"):
        HypergraphMemory().insert(["  "], "empty")
    m.check()  # failed operations left it consistent


def test_neighbourhood_is_the_bfs_ball_of_radius_hops():
    g = KnowledgeGraph()
    g.add_relation("A", "B", "ab", chunk=0)
    g.add_relation("B", "C", "bc", chunk=1)
    g.add_relation("C", "D", "cd", chunk=2)
    g.add_entity("E")
    assert g.neighbourhood(["a"], 2) == ["A", "B", "C"]
    assert set(g.neighbourhood(["a"], 3)) == {"A", "B", "C", "D"}
    assert g.neighbourhood(["a"], 0) == ["A"]
    assert g.neighbourhood(["nobody"], 2) == []
    assert [(r.source, r.target) for r in g.relations_among(["A", "B", "C"])] == [("A", "B"), ("B", "C")]
    assert g.entities["B"].chunks == {0, 1}


def test_vector_index_ranks_by_cosine_and_restricts_to_among():
    idx = VectorIndex(HashEmbedder())
    idx.add([0, 1, 2], ["red apples and pears", "the harbour of Velstead", "green pears"])
    assert idx.search("Velstead harbour", 1)[0][0] == 1
    assert [k for k, _ in idx.search("pears", 3, among={0, 2})] == [0, 2] or [
        k for k, _ in idx.search("pears", 3, among={0, 2})
    ] == [2, 0]
    assert 1 not in [k for k, _ in idx.search("Velstead", 3, among={0, 2})]


def test_vector_index_add_with_a_key_twice_in_one_call_keeps_its_last_text():
    """Qwen2.5-0.5B's evolve named one new entity twice; the second copy indexed a row not yet stored
    (IndexError) or, on an empty index, was stored twice."""
    emb = HashEmbedder()
    idx = VectorIndex(emb)
    idx.add(["a", "b", "a"], ["first a", "the b", "last a"])  # empty index
    assert idx.keys == ["a", "b"] and idx.vectors.shape[0] == 2
    assert torch.equal(idx.vectors[0], emb.encode(["last a"])[0])
    idx.add(["c", "a", "c"], ["first c", "again a", "last c"])  # stored key re-embedded, new key twice
    assert idx.keys == ["a", "b", "c"] and idx.vectors.shape[0] == 3
    assert torch.equal(idx.vectors[0], emb.encode(["again a"])[0])
    assert torch.equal(idx.vectors[2], emb.encode(["last c"])[0])


def test_chunks_are_200_tokens_with_50_overlap(tokenizer):
    text = " ".join(f"w{i}" for i in range(1000))
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = chunk_text(text, tokenizer, 200, 50)
    assert len(chunks) == -(-(len(ids) - 50) // 150)
    first = tokenizer.encode(chunks[0], add_special_tokens=False)
    second = tokenizer.encode(chunks[1], add_special_tokens=False)
    assert abs(len(first) - 200) <= 2 and tokenizer.decode(ids[150:200]).strip() in chunks[1]
    assert len(second) <= 202
    with pytest.raises(LonglabError, match="overlap"):
        HGMemConfig(overlap=200).check()


# --------------------------------------------------------------------------------- scripted backend
DOC = (
    "Alma Larkspur works for the Quartz Foundry. "
    + "Rivers bend and fill with reeds. " * 30
    + "The Quartz Foundry has its headquarters in Velstead. "
    + "Towns grew near the water. " * 30
    + "The Amber Guild has its headquarters in Kaldell."
)
CAP = re.compile(r"\b(?:[Tt]he )?((?:[A-Z][a-z]+ )+[A-Z][a-z]+|Velstead|Kaldell)\b")


class Scripted:
    """A deterministic stand-in model: it extracts capitalised names, records retrieved sentences that
    name an entity of the memory or the question, plans one local step then stops, and answers with the
    first city that appears in its answer context."""

    name = "scripted"

    def __init__(self):
        self.stats = BackendStats()
        self.prompts: list[str] = []

    def chat(self, messages, *, max_tokens=256, json_schema=None, temperature=0.0):
        p = messages[-1]["content"]
        self.prompts.append(p)
        self.stats.calls += 1
        if p.startswith("Extract"):
            text = p.split("Text:", 1)[1]
            names = sorted(set(CAP.findall(text)))
            ents = [{"name": n, "type": "concept", "description": n} for n in names]
            rels = [{"source": a, "target": b, "description": "related"} for a, b in zip(names, names[1:])]
            return json.dumps({"entities": ents, "relations": rels})
        if "Is the memory enough" in p:
            if "Velstead" in p:
                return json.dumps({"decision": "stop", "point_ids": [], "subquery": ""})
            return json.dumps(
                {"decision": "local", "point_ids": [0], "subquery": "Quartz Foundry headquarters"}
            )
        if "should become one point" in p:
            ids = [int(i) for i in re.findall(r"^\[(\d+)\]", p, re.M)]
            return json.dumps(
                {
                    "merge": [
                        {
                            "ids": ids[:2],
                            "description": "Alma works for the Quartz Foundry, headquartered in Velstead",
                        }
                    ]
                }
                if len(ids) >= 2
                else {"merge": []}
            )
        if "Record what" in p:
            chunks = p.split("-----Chunks-----", 1)[1]
            inserts = []
            for sent in re.split(r"(?<=\.) ", chunks):
                names = CAP.findall(sent)
                if "Larkspur" in sent or ("headquarters" in sent and "Quartz" in sent):
                    inserts.append({"objects": names, "description": sent.split("] ")[-1].strip()})
            return "Here you go: " + json.dumps({"insert": inserts, "update": []})
        city = re.search(r"Velstead|Kaldell", p.split("Answer the question")[0])
        return city.group(0) if city else "unknown"


def _index(backend, tokenizer, **cfg):
    return DocumentIndex.build(
        backend,
        DOC,
        HashEmbedder(),
        tokenizer=tokenizer,
        config=HGMemConfig(chunk_tokens=120, overlap=60, **cfg),
    )


def test_hgmem_loop_plans_retrieves_evolves_merges_and_answers(tokenizer):
    backend = Scripted()
    index = _index(backend, tokenizer)
    assert "QUARTZ FOUNDRY" in index.graph.entities and "VELSTEAD" in index.graph.entities
    cfg = HGMemConfig(chunk_tokens=120, overlap=60, top_chunks=2, top_entities=4)
    text, record = HGMem(backend, index, cfg, tokenizer=tokenizer).answer(
        "In which city is the main office of the employer of Alma Larkspur?"
    )
    rounds = record["trace"]["rounds"]
    assert rounds[0]["decision"] == "global" and rounds[1]["decision"] == "local"
    assert rounds[1]["point_ids"] == [0] and rounds[-1]["decision"] == "stop"
    # round 0 found hop 1 only (one chunk by the question); the local step reached hop 2 through the graph
    assert not any("Velstead" in index.chunks[c] for c in rounds[0]["chunks"])
    assert any("Velstead" in index.chunks[c] for c in rounds[1]["chunks"])
    assert (
        rounds[1].get("merged") == 1
    )  # points 0 and 1 became one hyperedge (id 3) over their objects' union
    assert (
        "[3] (ALMA LARKSPUR, QUARTZ FOUNDRY): Alma works for the Quartz Foundry, headquartered"
        in record["memory"]
    )
    assert "[0]" not in record["memory"] and "[1]" not in record["memory"]
    assert text == "Velstead"
    assert "headquartered in Velstead" in backend.prompts[-1]  # the answer reads the merged memory point


def test_hgmem_answer_is_wrong_when_the_loop_cannot_take_the_second_hop(tokenizer):
    """With one round (no plan, no local step) the memory holds hop 1 only: the scripted answer fails —
    the test above passes because of the loop, not because of the scripted model."""
    backend = Scripted()
    index = _index(backend, tokenizer)
    cfg = HGMemConfig(chunk_tokens=120, overlap=60, top_chunks=2, top_entities=4, max_rounds=1)
    text, record = HGMem(backend, index, cfg, tokenizer=tokenizer).answer(
        "In which city is the main office of the employer of Alma Larkspur?"
    )
    assert text != "Velstead" and len(record["trace"]["rounds"]) == 1


def test_copies_instruction_flags_echoes_of_the_request_not_facts():
    assert copies_instruction("what the retrieved text says about them", EVOLVE_INSTRUCTION)
    assert copies_instruction("  Its new description. ", EVOLVE_INSTRUCTION)  # case and punctuation aside
    assert copies_instruction("", EVOLVE_INSTRUCTION) and copies_instruction(" ", MERGE_INSTRUCTION)
    assert not copies_instruction("Alma Larkspur works for the Quartz Foundry", EVOLVE_INSTRUCTION)
    assert not copies_instruction("what the text says about them", EVOLVE_INSTRUCTION)  # not a run of it
    assert copies_instruction("what to look up next", PLAN_INSTRUCTION)
    # the worked example, copied or remixed (Qwen2.5-0.5B did both), is an echo unless the data says it
    data = "Question: What is the capital of Australia?\nRetrieved:\nUser is certain it is Sydney."
    copy, remix = "Ines Marlo studied with Petr Danek.", "Petr Danek is the violinist of the Harrow Quartet"
    assert copies_instruction(copy, EVOLVE_INSTRUCTION, data)
    assert copies_instruction(remix, EVOLVE_INSTRUCTION, data)
    assert not copies_instruction(remix, EVOLVE_INSTRUCTION)  # without the data only runs are caught
    assert not copies_instruction(remix, EVOLVE_INSTRUCTION, data + " " + remix)  # the text says it
    assert copies_instruction(copy, EVOLVE_INSTRUCTION, data + " " + copy)  # a verbatim run always is
    assert not copies_instruction("The capital of Australia is Sydney.", EVOLVE_INSTRUCTION, data)
    # no example words in the plan and merge instructions, and no sample value of version 1 anywhere
    for text in (PLAN_INSTRUCTION, MERGE_INSTRUCTION):
        assert '"' not in text and "'" not in text
    for text in (PLAN_INSTRUCTION, EVOLVE_INSTRUCTION, MERGE_INSTRUCTION):
        assert not any(f'"{v}"' in text for v in V1_SAMPLE_VALUES)


class Echoing(Scripted):
    """The scripted model, plus, in every evolve reply, one insert that copies the instruction's example
    and one update per memory point that echoes its words, and a sub-query that echoes the plan's (as
    SmolLM2 and Gemma-3-270M echoed the version-1 sample values, and Qwen2.5-0.5B the example)."""

    def chat(self, messages, *, max_tokens=256, json_schema=None, temperature=0.0):
        p = messages[-1]["content"]
        if "Is the memory enough" in p:
            self.prompts.append(p)
            return json.dumps({"decision": "global", "point_ids": [], "subquery": "what to look up next"})
        out = super().chat(messages, max_tokens=max_tokens, json_schema=json_schema, temperature=temperature)
        if "Record what" in p:
            ops = json.loads(out.split(": ", 1)[1])
            ops["insert"].append(
                {"objects": ["Alma Larkspur"], "description": "Ines Marlo studied with Petr Danek."}
            )
            ids = [int(i) for i in re.findall(r"^\[(\d+)\]", p.split("Retrieved:")[0], re.M)]
            ops["update"] = [{"id": i, "description": "its new description."} for i in ids]
            out = json.dumps(ops)
        return out


def test_echoed_descriptions_and_subqueries_are_dropped_and_counted(tokenizer):
    backend = Echoing()
    index = _index(backend, tokenizer)
    cfg = HGMemConfig(chunk_tokens=120, overlap=60, top_chunks=2, top_entities=4, max_rounds=2)
    question = "In which city is the main office of the employer of Alma Larkspur?"
    memory, trace = HGMem(backend, index, cfg, tokenizer=tokenizer).run_memory(question)
    assert [p.description for p in memory.points.values()] == ["Alma Larkspur works for the Quartz Foundry."]
    assert trace.rounds[1]["subquery"] == question  # the echoed sub-query fell back to the question
    assert [r["inserted"] for r in trace.rounds] == [1, 1] and [r["updated"] for r in trace.rounds] == [0, 0]
    assert trace.instruction_copies == 4  # 2 inserts, 1 update (round 1 has a point), 1 sub-query
    # without echoes nothing is dropped
    _, clean = HGMem(Scripted(), index, cfg, tokenizer=tokenizer).run_memory(question)
    assert clean.instruction_copies == 0


def test_an_echoed_merge_is_dropped_and_a_real_one_applied():
    m = HypergraphMemory()
    a = m.insert(["ALICE", "ACME"], "Alice works at Acme", [0])
    b = m.insert(["ACME", "PARIS"], "Acme is in Paris", [1])
    trace = Trace()
    echoed = {"merge": [{"ids": [a, b], "description": "The fact they make together."}]}
    assert HGMem.merge(m, echoed, trace) == 0
    assert sorted(m.points) == [a, b] and trace.instruction_copies == 1
    real = {"merge": [{"ids": [a, b], "description": "Alice works at Acme in Paris"}]}
    assert HGMem.merge(m, real, trace) == 1
    assert len(m.points) == 1 and trace.instruction_copies == 1


def test_rag_answer_sees_top_k_chunks_only(tokenizer):
    from longlab.memory.rag import ChunkStore, rag_answer

    backend = Scripted()
    store = ChunkStore(DOC, HashEmbedder(), tokenizer=tokenizer, chunk_tokens=120, overlap=60)
    q = "In which city is the main office of the employer of Alma Larkspur?"
    text, rec = rag_answer(backend, store, q, k=1)
    assert len(rec["chunks"]) == 1 and "Larkspur" in store.chunks[rec["chunks"][0]]
    assert text == "unknown"  # hop 2 is not among the top chunk
    text, rec = rag_answer(backend, store, q, k=len(store.chunks))
    assert text in ("Velstead", "Kaldell") and rec["chunks"] == sorted(rec["chunks"])


def test_answer_prompt_is_shared_by_every_system():
    msgs = answer_messages("Q?", "CTX")
    assert msgs[0]["content"].startswith("CTX\n\nAnswer the question") and msgs[0]["content"].endswith("Q?")


# ---------------------------------------------------------------------------------------- the tasks
def test_longdoc_multihop_facts_bounds_and_determinism(tokenizer):
    samples = longdoc_multihop(tokenizer, 1500, 6, seed=3, questions_per_doc=4, distractors=4)
    assert len(samples) == 6 and len({s.metadata["doc"] for s in samples}) == 2
    for s in samples:
        org, city = s.metadata["organization"], s.answers[0]
        assert f"{s.metadata['person']} works for the {org}." in s.context
        assert f"The {org} has its headquarters in {city}." in s.context
        assert org not in s.question and city not in s.question
        n = len(tokenizer.encode(s.context + s.question, add_special_tokens=False))
        assert 1300 <= n <= 1500
    assert [
        s.context for s in longdoc_multihop(tokenizer, 1500, 6, seed=3, questions_per_doc=4, distractors=4)
    ] == [s.context for s in samples]
    assert longdoc_multihop(tokenizer, 1500, 1, seed=4)[0].context != samples[0].context
    with pytest.raises(LonglabError, match="too small"):
        longdoc_multihop(tokenizer, 100, 8, questions_per_doc=8)
    with pytest.raises(LonglabError, match="at most"):
        longdoc_multihop(tokenizer, 10**7, 1)


def test_memory_jsonl_loader_reads_both_styles_and_refuses_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"document": "A long story.", "question": "Who?", "answers": ["Ann"]})
        + "\n\n"
        + json.dumps(
            {
                "conversation": [{"speaker": "Ann", "text": "I moved to Oslo."}],
                "question": "Where does Ann live?",
                "answer": "Oslo",
                "doc_id": "c1",
            }
        )
        + "\n"
    )
    a, b = load_memory_jsonl(good)
    assert a.context == "A long story." and a.answers == ["Ann"] and a.task == "memory_jsonl"
    assert b.context == "Ann: I moved to Oslo." and b.metadata["doc"] == "c1" and b.answers == ["Oslo"]
    for line, msg in (
        (json.dumps({"question": "q", "answers": ["a"]}), "context must be"),
        (json.dumps({"document": "d", "question": "q", "answers": []}), "answers must"),
        (
            json.dumps({"conversation": [{"speaker": 1}], "question": "q", "answer": "a"}),
            r"conversation\[0\]",
        ),
        ("[1, 2]", "JSON object"),
        ("{bad", "not a JSON"),
        (json.dumps({"document": "x" * 50, "question": "q", "answer": "a"}), "more than"),
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"document": "d", "question": "q", "answer": "a"}) + "\n" + line + "\n")
        with pytest.raises(LonglabError, match=msg) as err:
            load_memory_jsonl(bad, max_chars=40)
        assert "line 2" in str(err.value)
    with pytest.raises(LonglabError, match="no such file"):
        load_memory_jsonl(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------------------ runner
def test_parse_system_and_bad_systems():
    assert parse_system("hgmem") == ("hgmem", None)
    assert parse_system("rag:k=8") == ("rag", 8)
    assert parse_system("context:snapkv@0.5") == ("context", "snapkv@0.5")
    assert parse_system("reuse")[0] == "reuse"
    for bad in ("", "hgmem:x", "rag:k=0", "rag:8", "context:nosuchmethod", "bm25"):
        with pytest.raises(LonglabError):
            parse_system(bad)


def test_runner_rows_go_to_the_store_and_a_rerun_skips_them(tokenizer, tmp_path):
    from longlab.eval.store import ResultStore

    samples = longdoc_multihop(tokenizer, 600, 2, seed=0, questions_per_doc=2, distractors=1)
    backend = Scripted()
    with ResultStore(tmp_path) as store:
        rows = run_systems(
            backend,
            samples,
            ["hgmem", "rag:k=2"],
            embedder=HashEmbedder(),
            store=store,
            config=HGMemConfig(max_rounds=2),
            tokenizer=tokenizer,
            log=lambda m: None,
        )
        assert len(rows) == 4 and len(store) == 4
        calls = backend.stats.calls
        assert (
            run_systems(
                backend,
                samples,
                ["hgmem", "rag:k=2"],
                embedder=HashEmbedder(),
                store=store,
                config=HGMemConfig(max_rounds=2),
                tokenizer=tokenizer,
                log=lambda m: None,
            )
            == []
        )
        assert backend.stats.calls == calls  # nothing re-run
        stored = store.rows()
    assert {r["recipe"] for r in stored} == {"hgmem", "rag:k=2"}
    assert all(r["score"] in (0.0, 1.0) and r["extra"]["wall_per_question_s"] > 0 for r in stored)
    hg = [r for r in stored if r["recipe"] == "hgmem"]
    assert hg[0]["extra"]["chunks"] >= 1 and "trace" in hg[0]["extra"]
    with pytest.raises(LonglabError, match="local engine"):
        run_systems(backend, samples, ["context:full"], embedder=HashEmbedder(), tokenizer=tokenizer)


def test_a_changed_hgmem_setting_reruns_hgmem_but_not_the_baselines(tokenizer, tmp_path):
    """Each system's rows hash only what its answers depend on: another HGMem round budget (or instructions
    version) re-runs HGMem and keeps RAG's stored rows; another chunk size re-runs RAG."""
    from longlab.eval.store import ResultStore
    from longlab.memory import runner

    samples = longdoc_multihop(tokenizer, 600, 2, seed=0, questions_per_doc=2, distractors=1)

    def run(store, **cfg):
        return run_systems(Scripted(), samples, ["hgmem", "rag:k=2"], embedder=HashEmbedder(), store=store,
                           config=HGMemConfig(**cfg), tokenizer=tokenizer, log=lambda m: None)

    with ResultStore(tmp_path) as store:
        assert len(run(store, max_rounds=2)) == 4
        assert {r["recipe"] for r in run(store, max_rounds=1)} == {"hgmem"}
        assert {r["recipe"] for r in run(store, max_rounds=1, chunk_tokens=150)} == {"hgmem", "rag:k=2"}
        rag = [r for r in store.rows() if r["recipe"] == "rag:k=2"]
    assert all("hgmem_prompts" not in r["extra"] for r in rag)
    cfg, emb = HGMemConfig(), HashEmbedder()
    hg = runner.system_config("hgmem", cfg, emb)
    assert hg["prompts"] == runner.PROMPTS_VERSION and runner.system_config("context", cfg, emb) == {
        "answer_tokens": cfg.answer_tokens
    }


def test_extract_schema_is_accepted_by_the_checker():
    from longlab.memory import check_schema

    assert check_schema(EXTRACT_SCHEMA) is EXTRACT_SCHEMA


def test_page_is_generated_from_the_stored_rows(tokenizer, tmp_path):
    from longlab.cli import main
    from longlab.eval.stats import wilson_interval
    from longlab.eval.store import ResultStore

    samples = longdoc_multihop(tokenizer, 600, 4, seed=1, questions_per_doc=2, distractors=1)
    with ResultStore(tmp_path / "a") as store:
        rows = run_systems(Scripted(), samples, ["hgmem", "rag:k=1"], embedder=HashEmbedder(), store=store,
                           config=HGMemConfig(max_rounds=2), tokenizer=tokenizer, log=lambda m: None)
    out = tmp_path / "page.md"
    assert main(["memory", "page", str(tmp_path / "a"), "--out", str(out)]) == 0
    text = out.read_text()
    hg = [r["score"] for r in rows if r["recipe"] == "hgmem"]
    low, high = wilson_interval(int(sum(hg)), len(hg))
    assert f"| hgmem | {sum(hg) / len(hg):.3f} [{low:.3f}, {high:.3f}] | 4 |" in text
    assert "| hgmem - rag:k=1 |" in text and "hgmem internals:" in text
    assert "HGMem's instructions: version 3, 0 echoed descriptions or sub-queries dropped." in text
    assert main(["memory", "page", str(tmp_path / "missing"), "--out", str(out)]) == 2
