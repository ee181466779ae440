"""Structured output (``Request.response_format``): the grammar mask applied per row at every decode step.

Tiny random models: their free greedy output is byte noise, so a valid document can only come from the
mask. Schemas have bounded output (enums, booleans, bounded integers, maxLength strings) so the random
model finishes within ``max_new_tokens``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from longlab import Engine, Request, generate  # noqa: E402
from longlab.errors import LonglabError  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "unknown"]},
        "confident": {"type": "boolean"},
        "box": {"type": "integer", "minimum": 0, "maximum": 12},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "confident", "box", "note"],
    "additionalProperties": False,
}
FMT = {"type": "json_schema", "json_schema": {"name": "where", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Item 3 is stored in box 4. Item 5 is in box 9. Where is item 3?"}]


def _valid(text: str) -> dict:
    """Parse ``text`` and check it against SCHEMA by hand (keys, order, types, ranges)."""
    doc = json.loads(text)
    assert list(doc) == ["answer", "confident", "box", "note"]  # the schema's property order
    assert doc["answer"] in ("yes", "no", "unknown")
    assert isinstance(doc["confident"], bool)
    assert isinstance(doc["box"], int) and not isinstance(doc["box"], bool) and 0 <= doc["box"] <= 12
    assert isinstance(doc["note"], str) and len(doc["note"]) <= 6
    return doc


@pytest.fixture(scope="module")
def engine():
    from longlab.models import build_tiny_model, tiny_tokenizer

    return Engine(build_tiny_model("tiny-llama"), tiny_tokenizer())


def test_json_schema_output_validates_and_free_output_does_not(engine, one_thread):
    constrained, free = engine.run([
        Request(messages=MSGS, response_format=FMT, max_new_tokens=96),
        Request(messages=MSGS, max_new_tokens=96),
    ])
    assert constrained.finish_reason == "eos"
    _valid(constrained.text)
    with pytest.raises(ValueError):  # the same model and prompt without the mask: not JSON
        json.loads(free.text)


def test_json_object_parses_and_text_type_is_free(engine, one_thread):
    obj, text, free = engine.run([
        Request(messages=MSGS, response_format={"type": "json_object"}, max_new_tokens=64),
        Request(messages=MSGS, response_format={"type": "text"}, max_new_tokens=12),
        Request(messages=MSGS, max_new_tokens=12),
    ])
    # (any object: a random model may also stay inside a string until max_new_tokens; this prompt ends)
    assert obj.finish_reason == "eos" and isinstance(json.loads(obj.text), dict)
    assert text.token_ids == free.token_ids  # {"type": "text"} masks nothing


def test_constrained_and_free_rows_batched_equal_each_alone(engine, one_thread):
    reqs = [
        Request(messages=MSGS, response_format=FMT, max_new_tokens=80),
        Request(messages=MSGS, max_new_tokens=20),
        Request(context="Crate 4 holds apples. Crate 7 holds pears.", question="Which crate?",
                response_format={"type": "json_object"}, max_new_tokens=40),
        Request(messages=MSGS, response_format=FMT, max_new_tokens=80, temperature=0.8, seed=3),
    ]
    together = engine.run(reqs)
    assert max(r.extra["decode_batch"] for r in together) >= 3  # they did share a batch
    for req, got in zip(reqs, together):
        (alone,) = engine.run([req.with_fields()])
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
    _valid(together[0].text)
    _valid(together[3].text)  # sampled under the mask: still valid


def test_max_new_tokens_first_is_length_and_eos_waits_for_a_whole_document(engine, one_thread):
    from longlab.grammar import grammar_mask

    (cut,) = engine.run([Request(messages=MSGS, response_format=FMT, max_new_tokens=6)])
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6
    assert '{"answer": "'.startswith(cut.text)  # byte tokens: '{"answ'
    # tiny-llama: 260 logits, the tokenizer maps 259 ids; the padded id is never allowed, nor EOS early
    tok = engine.tokenizer
    assert engine.model.config.vocab_size == 260 and len(tok) == 259
    grammar = Request(context="x", response_format=FMT).check().parsed.grammar
    mask = grammar_mask(tok, grammar, 260, engine.eos)
    allowed = mask.allowed()
    assert allowed.shape == (260,) and not allowed[259] and not allowed[tok.eos_token_id]
    assert allowed.nonzero().flatten().tolist() == tok.convert_tokens_to_ids(["{"])
    doc = '{"answer": "no", "confident": false, "box": 3, "note": ""}'
    for t in tok(doc, add_special_tokens=False)["input_ids"]:
        assert mask.allowed()[t]
        mask.accept(t)
    allowed = mask.allowed()
    assert mask.complete and allowed[tok.eos_token_id] and allowed.sum() == 1 and not allowed[259]


def test_generate_messages_documents_and_other_lanes_take_response_format(engine, one_thread):
    out = generate(engine.model, engine.tokenizer, "Item 3 is stored in box 4.", "Where is item 3?",
                   recipe="full", response_format=FMT, max_new_tokens=96)
    _valid(out.texts[0])
    chat = generate(engine.model, engine.tokenizer, messages=MSGS, recipe="snapkv@0.5", response_format=FMT,
                    max_new_tokens=96)  # what [memory] sends: a chat under a compressing recipe
    _valid(chat.texts[0])
    (quant,) = engine.run([Request(messages=MSGS, recipe="kivi4", response_format=FMT, max_new_tokens=96)])
    assert quant.extra["decode_batch"] == 1  # quantized storage decodes in a lane of its own: masked too
    _valid(quant.text)
    (doc,) = engine.run([Request(documents=["Item 3 is stored in box 4.", "Item 5 is in box 9."],
                                 question="Where is item 3?", response_format=FMT, max_new_tokens=96)])
    _valid(doc.text)


@pytest.mark.parametrize("fmt, fields, message", [
    ({"type": "xml"}, {}, "response_format must be"),
    ("json", {}, "response_format must be"),
    ({"type": "json_schema"}, {}, "response_format json_schema needs"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, {}, "schema a JSON object"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, {}, "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": "yes"}}, {}, "strict"),
    ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 1000] * 70}}}, {}, "beyond the limit"),
    ({"type": "json_object"}, {"continuation": "yes"}, "continuation"),
    ({"type": "json_object"}, {"speculative": "lookup"}, "speculative"),
])
def test_bad_response_format_is_refused_naming_it(fmt, fields, message):
    with pytest.raises(LonglabError, match=message) as err:
        Request(context="Item 3 is in box 4.", question="Where?", response_format=fmt, **fields).check()
    assert "response_format" in str(err.value)


def test_strict_false_ignores_keywords_the_library_does_not_implement():
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}
    with pytest.raises(LonglabError, match="uniqueItems"):
        Request(context="x", response_format=fmt).check()
    fmt["json_schema"]["strict"] = False
    assert Request(context="x", response_format=fmt).check().parsed.grammar is not None


def test_compiled_grammars_are_cached_by_schema_text():
    from longlab.grammar import grammar_of

    first = grammar_of(FMT)
    assert grammar_of(json.loads(json.dumps(FMT))) is first  # same schema text: the cached grammar
    assert grammar_of({"type": "json_object"}) is not first


def test_strict_true_schema_parses_and_strict_true_refuses_what_strict_false_ignores():
    """``"strict": true`` (what OpenAI's SDKs send) compiles a supported schema and refuses an unsupported
    keyword, where ``"strict": false`` ignores it."""
    from longlab.grammar import grammar_of

    assert FMT["json_schema"]["strict"] is True and grammar_of(FMT) is not None
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    strict = {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema, "strict": True}}
    with pytest.raises(LonglabError, match="uniqueItems"):
        grammar_of(strict)
    assert grammar_of({**strict, "json_schema": {**strict["json_schema"], "strict": False}}) is not None


def test_logits_wider_than_the_tokenizer_get_a_mask_that_never_allows_the_padded_ids(one_thread):
    """Qwen pads its 151,665 tokenizer ids to 151,936 logits; here 259 ids padded to 300 logits (the pad
    crosses a 32-bit word of the packed mask). A hook on the LM head makes the padded ids' logits the
    largest, so unconstrained greedy decoding picks them; under the mask none is ever picked and the output
    validates."""
    from longlab.grammar import grammar_mask
    from longlab.models import build_tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model = build_tiny_model("tiny-llama", vocab_size=300)
    assert len(tok) == 259 and model.config.vocab_size == 300
    def padded_ids_win(module, inputs, out):  # out: [B, T, 300]
        out = out.clone()
        out[..., 259:] += 1e4
        return out

    model.lm_head.register_forward_hook(padded_ids_win)
    engine = Engine(model, tok)
    free, constrained = engine.run([Request(messages=MSGS, max_new_tokens=8),
                                    Request(messages=MSGS, response_format=FMT, max_new_tokens=96)])
    assert all(t >= 259 for t in free.token_ids)  # without the mask the padded ids are picked
    assert constrained.finish_reason == "eos" and max(constrained.token_ids) < 259
    _valid(constrained.text)
    grammar = Request(context="x", response_format=FMT).check().parsed.grammar
    mask = grammar_mask(tok, grammar, 300, engine.eos)
    for t in constrained.token_ids[:-1]:  # every step: the mask is 300 wide and no padded id is allowed
        allowed = mask.allowed()
        assert allowed.shape == (300,) and not allowed[259:].any() and allowed[t]
        mask.accept(t)
    assert mask.complete
