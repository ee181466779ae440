"""One registry: every method family (sparse selectors included) registered once with its paper and
parameters; one validator helper; one attention-capture helper that cleans up after itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import longlab  # noqa: F401  (registers every method family)
from longlab.capture import capture_attention
from longlab.cli import main as cli_main
from longlab.models import build_tiny_model
from longlab.recipe import RECIPE_METHODS, LonglabError, Method, check_choice, check_range, parse_recipe
from longlab.sparse import SELECTORS, BlockSelector, SparsePrefill, make_selector

SELECTOR_PAPERS = {  # the papers the selectors implement (arXiv ids)
    "ashape": "arXiv:2407.02490",
    "vslash": "arXiv:2407.02490",
    "blocktopk": "arXiv:2407.02490",
    "flexprefill": "arXiv:2502.20766",
    "xattention": "arXiv:2503.16428",
    "prism": "arXiv:2602.08426",
    "sale": "arXiv:2505.24179",
}


# ------------------------------------------------------------------------------------------ registry
def test_every_method_is_registered_once_with_a_paper_and_a_docstring():
    assert set(RECIPE_METHODS) >= set(SELECTOR_PAPERS) | {"snapkv", "kivi2", "quest", "full"}
    for name, cls in RECIPE_METHODS.items():
        assert cls.name == name and cls.paper and cls.__doc__, name
        assert cls.kind in ("prefill", "kv", "quant", "decode", "context"), name  # context: longlab.compress
    assert len(set(RECIPE_METHODS.values())) == len(RECIPE_METHODS)  # no class under two names


def test_selectors_are_the_registrys_prefill_policies():
    assert dict(SELECTORS) == {n: RECIPE_METHODS[n] for n in SELECTOR_PAPERS}  # one class per selector
    for name, paper in SELECTOR_PAPERS.items():
        cls = SELECTORS[name]
        assert issubclass(cls, BlockSelector) and issubclass(cls, SparsePrefill) and cls.kind == "prefill"
        assert cls.paper == paper
        recipe = parse_recipe(f"{name}+snapkv@0.5")
        assert type(recipe.prefill) is cls and recipe.prefill.reports_prefill_metrics
        assert type(make_selector(name)) is cls
    import longlab.sparse.prefill as prefill

    assert not hasattr(prefill, "PAPERS") and not hasattr(prefill, "PREFILL_POLICIES")


@pytest.mark.parametrize(
    "spec",
    ["vslash", "xattention", "prism", "ashape:n_local=128,backend=gather",
     "xattention:tau=0.95,backend=gather+snapkv@0.5", "flexprefill:gamma=0.95,max_budget=4096"],
)
def test_selector_recipe_names_round_trip(spec):
    recipe = parse_recipe(spec)
    assert recipe.name == spec
    assert parse_recipe(recipe.name).name == recipe.name


def test_backend_stays_the_last_parameter_of_every_selector():
    for cls in SELECTORS.values():
        assert [f.name for f in dataclasses.fields(cls)][-1] == "backend", cls.__name__


def test_methods_command_lists_every_family_with_paper_and_parameters(capsys):
    from longlab.registry import REGISTRY, param_range

    assert cli_main(["methods", "--markdown"]) == 0
    lines = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    listed = {(cells[2].strip().split(":")[0], cells[1].strip(" `")): cells for cells in lines}
    entries = REGISTRY.entries()
    assert set(listed) == {(fam, name) for fam, name, _ in entries}
    assert {fam for fam, _, _ in entries} == {"recipe", "reuse", "draft", "verify", "position", "mixer"}
    for fam, name, cls in entries:
        cells = [c.strip() for c in listed[(fam, name)]]
        assert cells[2] == (f"recipe:{cls.kind}" if fam == "recipe" else fam) and cells[3] == cls.paper
        for f in dataclasses.fields(cls):
            if f.init and f.default is not dataclasses.MISSING and not f.name.startswith("_"):
                assert f"{f.name}=" in cells[4], (name, f.name)
                if param_range(f):
                    assert param_range(f) in cells[4], (name, f.name)


# ------------------------------------------------------------------------------------------ validator
@pytest.mark.parametrize(
    "value, low, high, options, message",
    [
        (1.5, 0, 1, dict(high_open=True), "x must be in [0, 1), got 1.5"),
        (0, 1, None, dict(integer=True), "x must be an integer >= 1, got 0"),
        (-1.0, 0, None, dict(low_open=True), "x must be a positive number, got -1.0"),
        (0, 0, None, dict(integer=True, low_open=True), "x must be a positive integer, got 0"),
        ("abc", 0, 1, {}, "x must be a number in [0, 1], got 'abc'"),
        (True, 0, None, dict(integer=True), "x must be an integer >= 0, got True"),
        (2.0, 1, None, dict(integer=True), "x must be an integer >= 1, got 2.0"),
        (float("nan"), 0, 1, {}, "x must be a finite number in [0, 1], got nan"),
        (float("inf"), 0, None, dict(low_open=True), "x must be a finite positive number, got inf"),
        (10**30, 0, 1, {}, "x must be in [0, 1], got 1000000000000000000000000000000"),
        (9, 2, 8, dict(integer=True), "x must be an integer in [2, 8], got 9"),
    ],
)
def test_check_range_names_the_field_and_its_range(value, low, high, options, message):
    with pytest.raises(LonglabError) as err:
        check_range("x", value, low, high, **options)
    assert str(err.value) == message


def test_check_range_and_choice_return_what_they_accept():
    assert check_range("x", 0.5, 0, 1) == 0.5 and check_range("n", 3, 1, integer=True) == 3
    assert check_choice("p", "max", ("avg", "max")) == "max"
    with pytest.raises(LonglabError, match=r"^p must be 'avg' or 'max', got 'mean'$"):
        check_choice("p", "mean", ("avg", "max"))
    with pytest.raises(LonglabError, match=r"^b must be true or false, got 1$"):
        check_choice("b", 1, (True, False))  # 1 is not true
    with pytest.raises(LonglabError, match=r"^n must be 16, 8, 4 or 2, got 3$"):
        check_choice("n", 3, (16, 8, 4, 2))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv@1.5", "snapkv: compression_ratio must be in [0, 1), got 1.5"),
        ("snapkv:budget=0", "snapkv: budget must be an integer in [1, 1048576], got 0"),
        ("snapkv:pooling=mean", "snapkv: pooling must be 'avg' or 'max', got 'mean'"),
        ("h2o:recent_fraction=2", "h2o: recent_fraction must be in [0, 1], got 2"),
        ("restkv:tau=0", "restkv: tau must be in (0, 10], got 0"),
        ("kivi2:sink=-1", "kivi2: sink must be an integer in [0, 1048576], got -1"),
        ("pmkvq:budget_mb=1,window=0", "pmkvq: window must be an integer in [1, 1048576], got 0"),
        ("quest:min_pages=1", "quest: min_pages must be an integer in [2, 1048576], got 1"),
        ("retro:refresh=1", "retro: refresh must be true or false, got 1"),
        ("indexmem:gamma=0", "indexmem: gamma must be in (0, 1], got 0"),
        ("xattention:tau=1.1", "xattention: XAttention.tau must be in [0, 1], got 1.1"),
        ("ashape:backend=cuda",
         "ashape: AShape.backend must be 'auto', 'flash', 'grouped', 'flex', 'gather' or 'dense', "
         "got 'cuda'"),
    ],
)
def test_every_family_reports_through_the_one_helper(spec, message):
    with pytest.raises(LonglabError) as err:
        parse_recipe(spec)
    assert str(err.value) == message


def test_method_check_uses_the_field_label():
    @dataclasses.dataclass
    class Toy(Method):
        window: int = 4

        def validate(self) -> None:
            self.check("window", 1, integer=True)

    with pytest.raises(LonglabError, match=r"^Toy: window must be an integer >= 1, got 0$"):
        Toy(window=0)


# ------------------------------------------------------------------------------------------ capture
def _registered(name_prefix: str = "longlab_capture") -> set[str]:
    names = set(AttentionInterface._global_mapping) | set(AttentionMaskInterface._global_mapping)
    return {n for n in names if n.startswith(name_prefix)}


def test_capture_records_qkv_and_cleans_up(one_thread):
    model = build_tiny_model("tiny-llama", attn="sdpa")
    ids = torch.arange(24)[None] % 200
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        before = _registered()
        with capture_attention(model) as capture:
            name = model.config._attn_implementation
            assert name.startswith("longlab_capture") and name in AttentionInterface._global_mapping
            logits = model(ids, use_cache=False).logits
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert sorted(capture.records) == list(range(cfg.num_hidden_layers))
    module, q, k, v, scaling = capture.records[0]
    assert module.layer_idx == 0 and scaling == pytest.approx(head_dim**-0.5)
    assert q.shape == (1, cfg.num_attention_heads, 24, head_dim)
    assert k.shape == v.shape == (1, cfg.num_key_value_heads, 24, head_dim)
    torch.testing.assert_close(logits, reference)  # the capture attends as the model's own SDPA does
    assert model.config._attn_implementation == "sdpa"
    assert name not in AttentionInterface._global_mapping
    assert name not in AttentionMaskInterface._global_mapping
    assert _registered() == before


def test_capture_restores_the_model_after_an_exception(one_thread):
    model = build_tiny_model("tiny-llama", attn="eager")
    before = _registered()
    with pytest.raises(RuntimeError, match="boom"):
        with capture_attention(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"
    assert _registered() == before


def test_the_readme_methods_table_is_generated_from_the_registry():
    """The README table of every family is the registry's (`longlab methods --readme README.md`)."""
    from pathlib import Path

    from longlab.cli.methods import README_MARKERS, methods_markdown

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    start, end = README_MARKERS
    region = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert region == methods_markdown(), "README.md is stale: run `longlab methods --readme README.md`"
