"""COMI's trained soft variant (longlab.compress.comi: Fusion, train_fusion, comi@r:fusion=PATH)."""

from __future__ import annotations

import pytest
import torch

import longlab  # noqa: F401  (registers the methods)
from longlab.compress.api import compress_prompts, template_head
from longlab.compress.base import Prompt
from longlab.compress.comi import COMI, Fusion, answer_loss, load_fusion, save_fusion, train_fusion
from longlab.compress.scorer import Scorer
from longlab.generation import generate
from longlab.prompt import encode_prompts
from longlab.recipe import LonglabError, parse_recipe

FACTS = [(f"The code of the {c} vault is {n}.", c, str(n))
         for c, n in (("red", 417), ("blue", 862), ("green", 135), ("amber", 290))]


def _context(i: int) -> str:
    fact = FACTS[i][0]
    return " ".join(f"Crate {k} holds {k * 3 % 7} bolts." for k in range(12)) + " " + fact + " The end."


def _example(model, tokenizer, i: int, ratio: float = 0.75) -> tuple[dict, Prompt]:
    _, color, answer = FACTS[i]
    question = f"What is the code of the {color} vault?"
    (ctx,), (q,) = encode_prompts(tokenizer, [_context(i)], [question], ["The code is"])
    head = template_head(tokenizer, ctx)
    prompt = Prompt(ctx[head:], question, q, tokenizer)
    memories, states, _, _ = COMI(ratio).merge(prompt, Scorer(model))
    ans = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        lead = model.get_input_embeddings()(torch.tensor(ctx[:head], dtype=torch.long))
    return {"lead": lead.clone(), "memories": memories.clone(), "states": states.clone(),
            "tail": torch.tensor(q + ans, dtype=torch.long), "n_answer": torch.tensor(len(ans))}, prompt


def test_an_untrained_fusion_is_the_hard_variant(llama, tokenizer, tmp_path, one_thread):
    path = str(tmp_path / "zero.safetensors")
    save_fusion(Fusion(llama.config.hidden_size), path, trained="no")
    (ctx,), (q,) = encode_prompts(tokenizer, [_context(0)], ["What is the code of the red vault?"], [""])
    args = ([ctx], [q], ["What is the code of the red vault?"])
    hard = compress_prompts(llama, tokenizer, parse_recipe("comi@0.75").context, *args).rows[0]
    soft = compress_prompts(llama, tokenizer, parse_recipe(f"comi@0.75:fusion={path}").context, *args).rows[0]
    assert torch.equal(hard.embeds, soft.embeds) and hard.ids == soft.ids and soft.info["soft"]


def test_training_lowers_the_answer_loss_and_round_trips(llama, tokenizer, tmp_path, one_thread):
    torch.manual_seed(0)
    examples = [_example(llama, tokenizer, i)[0] for i in range(len(FACTS))]
    with torch.no_grad():
        before = sum(float(answer_loss(llama, Fusion(llama.config.hidden_size), e)) for e in examples)
    fusion, log = train_fusion(llama, examples, steps=40, lr=3e-3, log_every=10)
    with torch.no_grad():
        after = sum(float(answer_loss(llama, fusion, e)) for e in examples)
    assert after < 0.8 * before and len(log) == 4
    path = str(tmp_path / "trained.safetensors")
    save_fusion(fusion, path, model="tiny-llama")
    loaded = load_fusion(path, llama.config.hidden_size)
    e = examples[0]
    with torch.no_grad():
        assert torch.equal(loaded(e["memories"], e["states"]), fusion(e["memories"], e["states"]))
    r = generate(llama, tokenizer, _context(1), "What is the code of the blue vault?",
                 f"comi@0.75:fusion={path}", max_new_tokens=3)
    assert r.context[0]["merged"] and r.context[0]["soft"]


def test_a_bad_fusion_file_is_refused(llama, tokenizer, tmp_path):
    (ctx,), (q,) = encode_prompts(tokenizer, [_context(0)], ["What is the code?"], [""])
    missing = parse_recipe(f"comi@0.5:fusion={tmp_path / 'none.safetensors'}").context
    with pytest.raises(LonglabError, match="safetensors"):
        compress_prompts(llama, tokenizer, missing, [ctx], [q], ["What is the code?"])
    wrong = str(tmp_path / "wrong.safetensors")
    save_fusion(Fusion(8), wrong)
    with pytest.raises(LonglabError, match="hidden size"):
        compress_prompts(llama, tokenizer, parse_recipe(f"comi@0.5:fusion={wrong}").context, [ctx], [q],
                         ["What is the code?"])
    with pytest.raises(LonglabError, match="example"):
        train_fusion(llama, [], steps=3)


def test_train_comi_cli_writes_weights_and_manifest_and_never_a_users_file(tmp_path, capsys):
    """``longlab train comi``: a fusion layer whose recipe runs, with its manifest; a rerun replaces its own
    files; a user's file of the same name is refused and left as it was; bad settings name the flag."""
    import json

    from safetensors import safe_open

    from longlab.cli import main

    out = tmp_path / "fusion.safetensors"
    base = ["train", "comi", "--model", "tiny-llama", "--samples", "2", "--steps", "10", "--seq-len", "256",
            "--threads", "1"]
    assert main([*base, "--out", str(out)]) == 0, capsys.readouterr().err
    manifest = json.loads(out.with_suffix(".json").read_text())
    assert manifest["format"] == "longlab-comi-fusion" and manifest["ratio"] == 0.875
    assert manifest["samples"] == 2 and len(manifest["training"]["loss_every_10_steps"]) == 1
    assert all("-s1000-" in sid for sid in manifest["training"]["sample_ids"])  # never eval's seed-0 samples
    with safe_open(str(out), "pt") as fh:
        assert fh.metadata()["format"] == "longlab-comi-fusion"
    assert f"comi@0.875:fusion={out}" in capsys.readouterr().out
    model, tok = load_model_tiny()
    r = generate(model, tok, _context(1), "What is the code of the blue vault?", f"comi@0.875:fusion={out}",
                 max_new_tokens=2)
    assert r.context[0]["soft"]
    assert main([*base, "--out", str(out)]) == 0  # its own files: replaced
    # the page's table from a teacher-forced eval store of bench/configs/compression-comi-soft.toml
    from pathlib import Path

    from longlab.eval.pages.compression import comi_soft_table

    config = str(Path(__file__).resolve().parents[1] / "bench" / "configs" / "compression-comi-soft.toml")
    store = tmp_path / "store"
    assert main(["eval", "--config", config, "--model", "tiny-llama",
                 "--lengths", "256", "--samples", "2", "--out", str(store),
                 "--recipes", f"full,comi@0.875,comi@0.875:fusion={out}"]) == 0
    text = comi_soft_table(store, manifest)
    assert "| COMI-hard (training-free) (`comi@0.875`) | 2 |" in text and "COMI-soft (trained fusion)" in text
    assert "Soft − hard, paired on the same 2 samples" in text and "2 `redundant_niah` samples" in text
    hard_only = tmp_path / "hard"
    assert main(["eval", "--config", config, "--model", "tiny-llama", "--lengths", "256", "--samples", "1",
                 "--out", str(hard_only), "--recipes", "comi@0.875"]) == 0
    with pytest.raises(LonglabError, match="needs a comi@r row and a comi@r:fusion=PATH row"):
        comi_soft_table(hard_only)
    users = tmp_path / "mine.safetensors"
    users.write_bytes(b"my data")
    assert main([*base, "--out", str(users)]) == 2
    assert "longlab did not write it" in capsys.readouterr().err and users.read_bytes() == b"my data"
    manifest_only = tmp_path / "notes.safetensors"
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    assert main([*base, "--out", str(manifest_only)]) == 2
    assert "manifest" in capsys.readouterr().err and not manifest_only.exists()
    for extra, message in [
        (["--ratio", "1"], "--ratio must be"), (["--samples", "0"], "--samples must be"),
        (["--task", "nope"], "--task must be one of"), (["--minutes", "3"], "--minutes: an option of"),
        (["--rank", "4"], "--rank: an option of lora"), (["--out", str(tmp_path / "f.bin")], ".safetensors"),
    ]:
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def load_model_tiny():
    from longlab.models import load_model

    return load_model("tiny-llama")


def test_write_fusion_gives_both_files_a_new_files_usual_mode(llama, tmp_path):
    """Weights and manifest are renamed from temporaries: a new file's mode, not mkstemp's owner-only one."""
    from longlab.compress.comi_train import manifest_path, write_fusion
    from longlab.safeio import new_file_mode

    path = tmp_path / "fusion.safetensors"
    write_fusion(path, Fusion(llama.config.hidden_size), {"model": "tiny-llama"})
    assert path.stat().st_mode & 0o777 == manifest_path(path).stat().st_mode & 0o777 == new_file_mode()
    assert not list(tmp_path.glob(".*longlab-tmp"))
