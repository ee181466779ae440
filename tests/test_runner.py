"""Tests for ``longlab eval`` (longlab.eval.runner and the Ray backend), on tiny random models."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longlab.cli import main as cli_main
from longlab.engine import Engine
from longlab.engine.planner import tail_start
from longlab.engine.stream import Stream
from longlab.eval.config import EvalConfig
from longlab.eval.driver import run_eval
from longlab.eval.runner import SampleRunner
from longlab.eval.store import DB_NAME, ResultStore
from longlab.generation import generate
from longlab.recipe import LonglabError
from longlab.tasks import Sample, save_jsonl
from longlab.tasks import generate_samples as generate_task

SRC = Path(__file__).resolve().parents[1] / "src"
FAST = ["--model", "tiny-llama", "--max-new-tokens", "4", "--no-progress"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


EQUIV_RECIPES = [
    "full", "snapkv@0.5", "h2o@0.5", "h2o@0.75", "h2o@0.5:recent_fraction=0.25", "tova@0.5",
    "streaming@0.5", "adakv@0.5", "pyramidkv@0.75", "knorm@0.5", "h2o-stream:budget=400",
]


def _rows(out: Path) -> dict[str, tuple]:
    with ResultStore(out) as store:
        rows = store.rows()
    fields = ("recipe", "task", "sample_id", "prediction", "score")
    keyed = {r["run_key"]: tuple(r[f] for f in fields) for r in rows}
    assert len(keyed) == len(rows), "duplicate run keys"
    return keyed


def _sample(n_items: int = 24) -> Sample:
    context = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(n_items))
    return Sample(context, "Where is item 7 stored?", answer_prefix="Box", answers=["10"], max_new_tokens=5,
                  task="toy", sample_id="toy-0")


def test_tail_start_is_generates_last_chunk() -> None:
    # 1118 tokens in chunks of 128: generate's last chunk starts at 1024 (94 tokens >= 64)
    assert tail_start(1118, 10, 128, query_aware=False, need=64) == 1024
    # a 30-token last piece merges into the previous chunk (generate never compresses < 64 tokens)
    assert tail_start(1054, 10, 128, query_aware=False, need=64) == 896
    # query-aware: chunks of context + question; the prefix stays inside the context
    assert tail_start(1000, 30, 128, query_aware=True, need=64) == 896
    assert tail_start(1000, 200, 128, query_aware=True, need=64) == 1000
    # a large observation window moves the tail start earlier; a short context has no shared prefix
    assert tail_start(1118, 10, 128, query_aware=False, need=200) == 918
    assert tail_start(100, 10, 128, query_aware=False, need=64) == 0


@pytest.mark.parametrize(
    "model_name,query_aware,recipes",
    [
        ("tiny-llama", False, EQUIV_RECIPES),
        ("tiny-llama", True, ["full", "snapkv@0.5", "h2o@0.5", "tova@0.5"]),
        ("tiny-gemma3", False, ["full", "snapkv@0.5", "h2o@0.75", "streaming@0.5"]),
    ],
    ids=["llama", "llama-query-aware", "gemma3-sliding"],
)
def test_prefill_once_equals_independent_runs(tiny_models, tokenizer, model_name, query_aware, recipes):
    model = tiny_models[model_name][0]
    sample = _sample()
    config = EvalConfig(out="unused", model=model_name, chunk_size=128, query_aware=query_aware)
    rows = list(SampleRunner(model, tokenizer, config, "test").run(sample, recipes))
    assert sorted(r["recipe"] for r in rows) == sorted(recipes)
    shared = {r["recipe"]: r["extra"] for r in rows}
    # 666 tokens in chunks of 128: the 26-token last piece merges, the tail starts at 512
    assert {e["shared_prefill_tokens"] for e in shared.values()} == {512}
    # every recipe here is replayable: the tail was fed once per shared prefix, only compression per recipe
    assert all(e["replayed"] for e in shared.values())
    if "h2o-stream:budget=400" in shared:
        # H2O, H2O with another recent_fraction and streaming H2O all write H2O's accumulator: each
        # configuration needs its own shared prefix; the rest share one
        assert shared["full"]["shared_by"] == len(recipes) - 4
        assert shared["h2o@0.5"]["shared_by"] == 2 and shared["h2o-stream:budget=400"]["shared_by"] == 1
    else:
        assert shared["full"]["shared_by"] == len(recipes)
    for row in rows:
        ref = generate(
            model, tokenizer, sample.context, sample.question, row["recipe"], chunk_size=128,
            max_new_tokens=sample.max_new_tokens, query_aware=query_aware, compress="end",
            answer_prefix=sample.answer_prefix,
        )
        assert row["prediction"] == ref.text, row["recipe"]
        assert row["extra"]["generated_tokens"] == len(ref.token_ids[0])
        # the same bytes: the fork holds exactly what an independent run holds (no foreign H2O state)
        assert (row["kv_bytes_before"], row["kv_bytes_after"]) == (ref.kv_bytes_before, ref.kv_bytes_after)
        assert row["context_tokens"] == ref.context_tokens[0]


@pytest.mark.parametrize("query_aware", [False, True])
def test_compress_every_chunk_equals_independent_chunked_runs(tiny_models, tokenizer, query_aware):
    """``--compress chunk``: each compressing recipe prefills its whole prompt alone, cutting the cache
    after every chunk, and its row equals ``generate(..., compress="chunk")``; ``full`` still shares."""
    model = tiny_models["tiny-llama"][0]
    sample = _sample()
    recipes = ["full", "snapkv:budget=96", "streaming:budget=96", "h2o@0.5", "kivi4+snapkv@0.5"]
    config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128, query_aware=query_aware,
                        compress="chunk")
    rows = {r["recipe"]: r for r in SampleRunner(model, tokenizer, config, "t").run(sample, recipes)}
    assert set(rows) == set(recipes)
    for recipe, row in rows.items():
        assert row["extra"]["shared_prefill_tokens"] == (512 if recipe == "full" else 0)
        ref = generate(
            model, tokenizer, sample.context, sample.question, recipe, chunk_size=128,
            max_new_tokens=sample.max_new_tokens, query_aware=query_aware, compress="chunk",
            answer_prefix=sample.answer_prefix,
        )
        assert row["prediction"] == ref.text, recipe
        assert (row["kv_bytes_before"], row["kv_bytes_after"]) == (ref.kv_bytes_before, ref.kv_bytes_after)
    # the policy ran after every chunk (once per layer per chunk), not once at the end
    n_chunks = rows["full"]["context_tokens"] // 128  # 666 tokens: 5 chunks (the last piece merges)
    assert n_chunks >= 4
    for recipe in ("snapkv:budget=96", "streaming:budget=96"):
        assert rows[recipe]["extra"]["compress_calls"] >= model.config.num_hidden_layers * n_chunks
    end = EvalConfig(out="unused", model="tiny-llama", chunk_size=128, query_aware=query_aware)
    once = {r["recipe"]: r for r in SampleRunner(model, tokenizer, end, "t").run(sample, recipes[:2])}
    assert rows["full"]["prediction"] == once["full"]["prediction"]  # nothing to cut: the same run


def test_compress_is_part_of_the_config_identity(tmp_path: Path, capsys) -> None:
    assert "compress" not in EvalConfig(out="x").identity()  # stores written before the option keep theirs
    assert EvalConfig(out="x", compress="chunk").identity()["compress"] == "chunk"
    with pytest.raises(ValueError, match="--compress must be 'end' or 'chunk'"):
        EvalConfig(out="x", compress="every").validate()
    argv = ["eval", "--model", "tiny-llama", "--reuse", "cacheblend:recompute=0.15", "--compress", "chunk",
            "--out", str(tmp_path / "x")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "--compress chunk: with --reuse the recipe compresses the assembled cache once" in err


@pytest.mark.parametrize(
    "model_name,query_aware", [("tiny-llama", False), ("tiny-llama", True), ("tiny-gemma3", False)]
)
def test_batch_decode_equals_one_stream_per_recipe(tiny_models, tokenizer, model_name, query_aware):
    model = tiny_models[model_name][0]
    sample = _sample()
    recipes = ["full", "snapkv@0.5", "h2o@0.75", "adakv@0.5", "streaming@0.5"]
    rows = {}
    for batch_decode in (False, True):
        config = EvalConfig(out="unused", model=model_name, chunk_size=128, query_aware=query_aware,
                            max_new_tokens=12, batch_decode=batch_decode)
        runner = SampleRunner(model, tokenizer, config, "t")
        rows[batch_decode] = {r["recipe"]: r for r in runner.run(sample, recipes)}
    for recipe in recipes:
        one, batched = rows[False][recipe], rows[True][recipe]
        assert batched["extra"]["decode_batch"] == len(recipes) and one["extra"]["decode_batch"] == 1
        assert batched["prediction"] == one["prediction"], recipe
        assert batched["kv_bytes_after"] == one["kv_bytes_after"]


def test_batch_decode_leaves_out_layers_that_cannot_stack(tiny_models, tokenizer):
    """ReST-KV's layers hold one head per query head: its branch decodes alone, the others together,
    with the same answers as one stream per recipe."""
    model = tiny_models["tiny-llama"][0]
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA: restkv repeats heads
    recipes = ["full", "restkv@0.5", "snapkv@0.5"]
    rows = {}
    for batch_decode in (False, True):
        config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128, max_new_tokens=8,
                            batch_decode=batch_decode)
        rows[batch_decode] = {r["recipe"]: r for r in SampleRunner(model, tokenizer, config, "t").run(
            _sample(), recipes)}
    assert rows[True]["restkv@0.5"]["extra"]["decode_batch"] == 1
    assert rows[True]["full"]["extra"]["decode_batch"] == 2
    for recipe in recipes:
        assert rows[True][recipe]["prediction"] == rows[False][recipe]["prediction"], recipe


def test_batch_decode_drops_finished_rows_and_keeps_every_row(tiny_models, tokenizer, monkeypatch):
    """Rows that emit EOS leave the batched decode; every row still equals its own stream's."""
    model = tiny_models["tiny-llama"][0]
    sample = _sample()
    sample.max_new_tokens = 12
    recipes = ["full", "snapkv@0.5", "h2o@0.75", "streaming@0.5", "knorm@0.5"]
    decoded: dict[str, list[int]] = {}
    widths: list[int] = []
    feed = Stream.feed
    finish = Engine._finish

    def spy_finish(self, row):
        result = finish(self, row)
        decoded[result.request.id] = result.token_ids
        return result

    def spy_feed(self, rows, *args, **kwargs):
        if all(len(r) == 1 for r in rows):
            widths.append(len(rows))
        return feed(self, rows, *args, **kwargs)

    monkeypatch.setattr(Engine, "_finish", spy_finish)
    monkeypatch.setattr(Stream, "feed", spy_feed)

    def run(batch_decode: bool, eos: set[int]) -> dict[str, dict]:
        config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128, batch_decode=batch_decode)
        runner = SampleRunner(model, tokenizer, config, "t")
        runner.engine.eos = eos
        decoded.clear()
        widths.clear()
        return {r["recipe"]: r for r in runner.run(sample, recipes)}

    run(False, set())
    tokens = dict(decoded)  # each row's tokens
    eos = {tokens["full"][2], tokens["snapkv@0.5"][7]}
    one = run(False, eos)
    batched = run(True, eos)
    assert max(widths) == len(recipes) and min(widths) < len(recipes)  # finished rows left the batch
    lengths = {r["extra"]["generated_tokens"] for r in one.values()}
    assert len(lengths) > 1 and min(lengths) < 12  # rows stopped at different steps
    for name in recipes:
        assert batched[name]["extra"]["decode_batch"] == len(recipes)
        assert batched[name]["prediction"] == one[name]["prediction"], name
        assert batched[name]["extra"]["generated_tokens"] == one[name]["extra"]["generated_tokens"], name


def test_max_new_tokens_caps_each_samples_limit(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    sample = _sample()  # its own limit: 5 tokens
    for cap, expected in ((None, 5), (12, 5), (3, 3)):
        config = EvalConfig(out="unused", model="tiny-llama", chunk_size=128, max_new_tokens=cap)
        runner = SampleRunner(model, tokenizer, config, "t")
        runner.engine.eos = set()  # every row runs to its limit
        (row,) = runner.run(sample, ["full"])
        assert row["extra"]["max_new_tokens"] == row["extra"]["generated_tokens"] == expected


def test_the_default_eval_path_batches_the_decode():
    from longlab.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["eval", "--out", "x"]).batch_decode is None  # on, off with --speculative
    assert parser.parse_args(["eval", "--out", "x", "--no-batch-decode"]).batch_decode is False
    assert EvalConfig(out="x").decode_in_batch is True
    assert EvalConfig(out="x", speculative=["lookup"]).decode_in_batch is False


def test_cli_end_to_end_then_rerun_skips(tmp_path: Path, capsys) -> None:
    out = tmp_path / "x"
    argv = ["eval", *FAST, "--recipes", "full,snapkv@0.5", "--tasks", "niah_single_1,vt",
            "--lengths", "512,1100", "--samples", "2", "--out", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    # vt needs >= 1066 byte tokens: it runs at 1100 only (512 is skipped with a warning)
    assert len(rows) == 2 * 2 * 2 + 1 * 2 * 2
    assert {r[1] for r in rows.values()} == {"niah_single_1", "vt"}
    assert (out / "report.md").is_file() and str(out / "report.md") in printed
    with ResultStore(out) as store:
        row = store.rows(recipe="snapkv@0.5")[0]
    assert row["method"] == "snapkv" and row["compression_ratio"] == 0.5 and row["config_hash"]
    assert row["kv_bytes_after"] < row["kv_bytes_before"] and row["peak_rss_mb"] > 0
    assert row["prefill_s"] >= row["extra"]["shared_prefill_s"] > 0
    assert "SnapKV(" in row["recipe_repr"] and row["package_version"]
    with ResultStore(out) as store:
        stamps = {r["run_key"]: r["created_at"] for r in store.rows()}

    summary = run_eval(EvalConfig(
        out=str(out), model="tiny-llama", recipes=["full", "snapkv@0.5"], tasks=["niah_single_1", "vt"],
        lengths=[512, 1100], samples=2, max_new_tokens=4, report=False, progress=False,
    ))
    assert (summary.written, summary.skipped, summary.total) == (0, 12, 12)
    with ResultStore(out) as store:
        assert {r["run_key"]: r["created_at"] for r in store.rows()} == stamps


def test_new_recipe_adds_rows_only_for_it(tmp_path: Path) -> None:
    base = dict(out=str(tmp_path), model="tiny-llama", tasks=["niah_single_1"], lengths=[512], samples=2,
                max_new_tokens=4, report=False, progress=False)
    run_eval(EvalConfig(recipes=["full"], **base))
    summary = run_eval(EvalConfig(recipes=["full", "streaming@0.5"], **base))
    assert (summary.written, summary.skipped) == (2, 2)
    assert len(_rows(tmp_path)) == 4


def test_skip_rows_leaves_out_the_cells_measured_elsewhere(tmp_path: Path) -> None:
    base = dict(model="tiny-llama", recipes=["full", "streaming@0.5"], tasks=["niah_single_1"], lengths=[512],
                samples=2, max_new_tokens=4, report=False, progress=False)
    ref = run_eval(EvalConfig(out=str(tmp_path / "ref"), **base))
    with ResultStore(tmp_path / "ref") as store:
        rows = store.rows()
    first = rows[0]
    wrong_compress = next(r for r in rows if r["run_key"] != first["run_key"])
    committed = [
        {k: first[k] for k in ("model", "recipe", "task", "length", "sample_id")},  # skipped
        {**{k: wrong_compress[k] for k in ("model", "recipe", "task", "length", "sample_id")},
         "compress": "chunk"},  # another sweep's row: run
        {"model": "other-model", "recipe": "full", "task": "niah_single_1", "length": 512, "sample_id": "x"},
    ]
    path = tmp_path / "committed.json"
    path.write_text(json.dumps(committed))
    summary = run_eval(EvalConfig(out=str(tmp_path / "new"), skip_rows=str(path), **base))
    assert (summary.written, summary.skipped, summary.total) == (ref.written - 1, 1, ref.total)
    new = _rows(tmp_path / "new")
    assert first["run_key"] not in new and set(new) == set(_rows(tmp_path / "ref")) - {first["run_key"]}


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"), ('{"a": 1}', "expected a JSON list"), ('[{"model": "m"}]', "row 0 is not an object"),
    ('[{"model": "m", "recipe": "nope", "task": "t", "length": 1, "sample_id": "s"}]', "row 0"),
])
def test_skip_rows_refuses_a_bad_file_before_loading(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rows.json"
    path.write_text(text)
    with pytest.raises(LonglabError, match=message):
        EvalConfig(out=str(tmp_path), model="tiny-llama", skip_rows=str(path)).validate()
    with pytest.raises(LonglabError, match="cannot read"):
        EvalConfig(out=str(tmp_path), model="tiny-llama", skip_rows=str(tmp_path / "missing.json")).validate()


def test_killed_run_resumes_to_the_same_rows(tmp_path: Path) -> None:
    args = ["--recipes", "full,snapkv@0.5,h2o@0.5", "--tasks", "niah_single_1", "--lengths", "512",
            "--samples", "4", "--max-new-tokens", "16", "--no-report", "--no-progress",
            "--model", "tiny-llama"]
    killed, ref = tmp_path / "killed", tmp_path / "ref"
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "longlab.cli", "eval", *args, "--out", str(killed)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    n_at_kill = 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with sqlite3.connect(killed / DB_NAME, timeout=1) as conn:
                    n_at_kill = conn.execute("SELECT COUNT(*) FROM results").fetchone()[0]
            except sqlite3.Error:
                n_at_kill = 0
            if n_at_kill >= 2:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert 0 < n_at_kill < 12
    assert cli_main(["eval", *args, "--out", str(killed)]) == 0  # resume
    assert cli_main(["eval", *args, "--out", str(ref)]) == 0  # uninterrupted reference
    assert _rows(killed) == _rows(ref) and len(_rows(ref)) == 12


def test_jsonl(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "mine.jsonl"
    samples = generate_task("niah_single_1", tokenizer, 512, 2, seed=3)
    samples.append(_sample(30))
    samples[-1].task = ""  # no task: named after the file
    save_jsonl(samples, path)
    out = tmp_path / "out"
    assert cli_main(["eval", *FAST, "--jsonl", str(path), "--recipes", "full,knorm@0.5", "--out", str(out),
                     "--no-report"]) == 0
    rows = _rows(out)
    assert len(rows) == 3 * 2
    assert {r[1] for r in rows.values()} == {"niah_single_1", "mine"}
    assert {r[2] for r in rows.values()} == {s.sample_id for s in samples}
    assert cli_main(["eval", *FAST, "--jsonl", str(path), "--recipes", "full", "--limit", "1",
                     "--out", str(tmp_path / "one"), "--no-report"]) == 0
    assert len(_rows(tmp_path / "one")) == 1


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
        (["--recipes", "full,nosuch@0.5"], "unknown recipe method 'nosuch'"),
        (["--recipes", "snapkv@1.5"], "compression_ratio"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--lengths", "0"], "--lengths must be an integer in [1, "),
        (["--lengths", "512,-3"], "--lengths must be an integer in [1, "),
        (["--samples", "0"], "--samples must be an integer in [1, "),
        (["--jsonl", "/no/such/file.jsonl"], "no such file"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(tmp_path: Path, capsys, extra: list[str], needle: str):
    argv = ["eval", "--model", "tiny-llama", "--tasks", "niah_single_1", "--lengths", "512",
            "--out", str(tmp_path / "x"), *extra]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "x" / DB_NAME).exists()  # failed before touching the store


def test_bad_list_argument_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["eval", "--lengths", "1k", "--out", "x"])
    assert exc.value.code == 2 and "--lengths" in capsys.readouterr().err


def test_ray_missing_names_the_extra(monkeypatch) -> None:
    from longlab.eval import ray_backend
    from longlab.recipe import LonglabError

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(LonglabError, match=r"pip install 'longlab\[ray\]'"):
        ray_backend.require_ray()


@pytest.mark.slow
def test_ray_backend_rows_equal_serial(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    base = dict(model="tiny-llama", recipes=["full", "snapkv@0.5", "h2o@0.5"], tasks=["niah_single_1"],
                lengths=[512], samples=3, max_new_tokens=8, report=False, progress=False)
    serial = run_eval(EvalConfig(out=str(tmp_path / "serial"), **base))
    ray_run = run_eval(EvalConfig(out=str(tmp_path / "ray"), backend="ray", workers=2, **base))
    assert serial.written == ray_run.written == 9
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "serial")
    with ResultStore(tmp_path / "ray") as store:
        extras = [r["extra"] for r in store.rows()]
    assert {e["backend"] for e in extras} == {"ray"} and len({e["worker_pid"] for e in extras}) == 2


def test_a_second_eval_on_the_same_out_is_told_and_writes_nothing(tmp_path: Path) -> None:
    """Two runs on one --out would redo each other's rows: the second is refused while the first writes."""
    from longlab.eval.driver import _WriterLock

    base = dict(model="tiny-llama", recipes=["full"], tasks=["niah_single_1"], lengths=[512], samples=1,
                max_new_tokens=2, progress=False, report=False)
    run_eval(EvalConfig(out=str(tmp_path), **base), log=lambda m: None)  # creates the store
    first = _WriterLock(tmp_path)  # a run holding the directory
    try:
        with pytest.raises(LonglabError, match=r"another longlab eval \(pid \d+\) is writing these results"):
            run_eval(EvalConfig(out=str(tmp_path), **{**base, "samples": 2}), log=lambda m: None)
    finally:
        first.close()
    summary = run_eval(EvalConfig(out=str(tmp_path), **{**base, "samples": 2}), log=lambda m: None)
    assert (summary.written, summary.skipped) == (1, 1)
    assert not (tmp_path / _WriterLock.NAME).exists()
