"""The prompt layouts of longlab.prompt: kvpress's pipeline layout by default, longlab's former one and
plain completion text as options, chosen per sample through ``metadata["prompt"]``."""

from __future__ import annotations

import pytest

from longlab.eval.config import EvalConfig
from longlab.eval.runner import SampleRunner
from longlab.models import tiny_tokenizer
from longlab.prompt import DEFAULT_LAYOUT, build_prompt, encode_prompts, resolve_layout
from longlab.tasks import Sample

# a ChatML template with a system turn, the shape of SmolLM2's
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nBe brief."
    "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT = "The code of the red vault is 4821."
QUESTION = "What is the code of the red vault?"


@pytest.fixture
def chat_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHATML
    return tok


def _kvpress_preprocess(tokenizer, context: str, question: str, answer_prefix: str) -> tuple[str, str]:
    """kvpress 0.5's KVPressTextGenerationPipeline.preprocess, written out by hand: the context is rendered
    alone in the user turn with a '#' marker after it, split there, and the question goes after it."""
    marker = "#" * (len(context) + 10)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + marker}], add_generation_prompt=True, tokenize=False
    )
    head, suffix = rendered.split(marker)
    return head, question + suffix + answer_prefix


def test_default_layout_is_kvpress_pipeline_layout(chat_tokenizer) -> None:
    assert DEFAULT_LAYOUT == "chat"
    ctx, q = build_prompt(chat_tokenizer, CONTEXT, QUESTION, "The code is")
    assert (ctx, q) == _kvpress_preprocess(chat_tokenizer, CONTEXT, QUESTION, "The code is")
    # hand-written: the system turn and user header are compressed with the context; the question is
    # glued to the context (no separator) and the answer prefix follows the assistant header verbatim
    assert ctx == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + CONTEXT
    assert q == QUESTION + "<|im_end|>\n<|im_start|>assistant\nThe code is"


def test_chat_sep_is_longlabs_former_layout(chat_tokenizer) -> None:
    ctx, q = build_prompt(chat_tokenizer, CONTEXT, QUESTION, "The code is", "chat-sep")
    assert ctx == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + CONTEXT
    assert q == "\n\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\nThe code is"
    # the ids kvpress builds when handed "\n\n" + question
    # (bench/vs_kvpress.py run --kvpress-question longlab)
    assert (ctx, q) == _kvpress_preprocess(chat_tokenizer, CONTEXT, "\n\n" + QUESTION, "The code is")


def test_plain_layout_and_fallbacks(chat_tokenizer, tokenizer) -> None:
    plain = (CONTEXT, "\n" + QUESTION + " The code is")
    assert build_prompt(chat_tokenizer, CONTEXT, QUESTION, "The code is", False) == plain
    assert build_prompt(chat_tokenizer, CONTEXT, QUESTION, "The code is", "plain") == plain
    # a tokenizer without a chat template gets the plain layout whatever is asked
    for layout in (True, "chat", "chat-sep"):
        assert build_prompt(tokenizer, CONTEXT, QUESTION, "The code is", layout) == plain
        assert resolve_layout(layout, tokenizer) == "plain"
    assert build_prompt(chat_tokenizer, CONTEXT, None, "Go") == (CONTEXT, "Go")  # nothing to ask


@pytest.mark.parametrize("bad", ["chat_sep", "", "kvpress", 1, None])
def test_unknown_layout_is_refused_naming_the_choices(chat_tokenizer, bad) -> None:
    with pytest.raises(ValueError, match="'chat', 'chat-sep', 'plain'"):
        build_prompt(chat_tokenizer, CONTEXT, QUESTION, "", bad)


def test_encode_prompts_per_row_layouts(chat_tokenizer) -> None:
    ctx, q = encode_prompts(
        chat_tokenizer, [CONTEXT] * 3, [QUESTION] * 3, ["A:"] * 3, ["chat", "chat-sep", "plain"]
    )
    assert ctx[0] == ctx[1] != ctx[2]  # templated rows share the context part; plain has no header
    assert q[1][:2] == chat_tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    assert q[1][2:] == q[0]  # chat-sep = chat with the separator in front (byte-level tokens)
    assert ctx[2] == chat_tokenizer(CONTEXT)["input_ids"]  # plain: the context alone, special tokens kept


def test_sample_prompt_key_is_checked() -> None:
    row = {"context": CONTEXT, "question": QUESTION, "answers": ["4821"]}
    assert Sample.from_dict({**row, "prompt": "chat-sep"}).metadata["prompt"] == "chat-sep"
    assert Sample.from_dict({**row, "metadata": {"prompt": "plain"}}).metadata["prompt"] == "plain"
    assert "prompt" not in Sample.from_dict(row).metadata
    with pytest.raises(ValueError, match="'prompt' names the prompt layout"):
        Sample.from_dict({**row, "prompt": "Answer the question below."})


@pytest.mark.usefixtures("one_thread")
def test_eval_runner_uses_each_samples_layout(tiny_models, chat_tokenizer, tmp_path) -> None:
    model, _ = tiny_models["tiny-llama"]
    runner = SampleRunner(model, chat_tokenizer, EvalConfig(out=str(tmp_path), recipes=["full"]), "h")
    seen = {}
    for layout in ("chat", "chat-sep", "plain"):
        sample = Sample(CONTEXT * 4, QUESTION, "Code:", ["4821"], 2, task="toy", sample_id=layout,
                        metadata={"prompt": layout})
        (row,) = runner.run(sample, ["full"])
        seen[layout] = (row["context_tokens"], row["extra"]["question_tokens"])
    (ctx,), (q,) = encode_prompts(chat_tokenizer, [CONTEXT * 4], [QUESTION], ["Code:"], "chat")
    assert seen["chat"] == (len(ctx), len(q))
    assert seen["chat-sep"] == (len(ctx), len(q) + 2)  # the two "\n" bytes
    assert seen["plain"][0] == len(CONTEXT * 4)  # one token per byte, no chat header
