"""The documentation site: generated blocks (fill, errors, drift against the committed data) and the
strict mkdocs build (a broken link or a warning fails)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longlab.eval import docs_tables
from longlab.eval.docs_tables import BEGIN, END, block_names, check_docs, fill_blocks, generators, repo_root
from longlab.eval.pages.methods import FAMILY_METHODS, family_params_table
from longlab.recipe import LonglabError

ROOT = Path(__file__).resolve().parents[1]
FAST_PAGES = ("decode-speed", "entropylong", "serve-load", "vs-kvpress",
              *(f"families/{p}" for p in FAMILY_METHODS))


def _page(*names: str) -> str:
    body = "\n\n".join(f"{BEGIN.format(name=n)}\nold {n}\n{END.format(name=n)}" for n in names)
    return f"# Title\n\nprose before\n\n{body}\n\nprose after\n"


def test_fill_blocks_replaces_only_between_markers() -> None:
    text = _page("a", "b")
    new, changed = fill_blocks(text, {"a": "| x |\n|---|\n| 1 |", "b": "table b"})
    assert changed == ["a", "b"]
    assert new.startswith("# Title\n\nprose before\n\n") and new.endswith("\n\nprose after\n")
    assert "old a" not in new and "| 1 |" in new and "table b" in new
    assert block_names(new) == ["a", "b"]
    again, changed = fill_blocks(new, {"a": "| x |\n|---|\n| 1 |", "b": "table b"})
    assert again == new and changed == []  # idempotent: a second run changes nothing
    _, changed = fill_blocks(new, {"a": "| x |\n|---|\n| 2 |", "b": "table b"})
    assert changed == ["a"]  # one number differs: that block, not the other, is reported


def test_fill_blocks_refuses_missing_and_orphan_markers() -> None:
    with pytest.raises(LonglabError, match=r"no marker pair.*\['c'\]"):
        fill_blocks(_page("a"), {"a": "x", "c": "y"}, page="p.md")
    with pytest.raises(LonglabError, match=r"p.md: marker pair\(s\) \['b'\] that no generator fills"):
        fill_blocks(_page("a", "b"), {"a": "x"}, page="p.md")
    with pytest.raises(LonglabError, match="no <!-- END generated:a --> marker"):
        block_names(BEGIN.format(name="a") + "\nnothing closes it\n")
    with pytest.raises(LonglabError, match="named twice"):
        block_names(_page("a", "a"))


def test_repo_root_and_unknown_page(tmp_path: Path) -> None:
    assert repo_root(ROOT / "src" / "longlab") == ROOT
    with pytest.raises(LonglabError, match="no mkdocs.yml"):
        repo_root(tmp_path)
    with pytest.raises(LonglabError, match="--page: unknown page 'nope'"):
        check_docs(ROOT, page="nope")


def test_family_params_table_lists_registry_ranges() -> None:
    table = family_params_table("kv-quant")
    assert "`kivi4`" in table and "`pmkvq`" in table and "`snapkv`" not in table
    assert "`group_size` = `32` (an integer in [1, 16384])" in table  # KIVI's declared range
    kv = family_params_table("kv-eviction")
    assert "`snapkv`" in kv and "`quest`" in kv and "`hico-drop`" not in kv and "`losa`" not in kv
    # every registered method is on exactly one family page (entropylong and serving have none)
    from longlab import methods  # noqa: F401
    from longlab.registry import REGISTRY

    for family, name, cls in REGISTRY.entries():
        pages = [p for p, pick in FAMILY_METHODS.items() if pick(family, name, cls)]
        assert len(pages) == 1, (family, name, pages)


def test_every_generated_page_is_in_the_site_and_has_its_markers() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for gen in generators():
        assert gen.page.removeprefix("docs/") in nav, gen.page
        assert block_names((ROOT / gen.page).read_text(encoding="utf-8")), gen.page


@pytest.mark.parametrize("page", FAST_PAGES)
def test_fast_pages_match_their_data(page: str) -> None:
    """Drift check of the pages that render in well under a second (the rest: the slow test below)."""
    assert check_docs(ROOT, page=page) == []


def test_drift_is_detected(tmp_path: Path) -> None:
    """A copy of the repository's page with one generated number changed is reported, and generate
    puts it back (the check can fail)."""
    for sub in ("docs/results", "bench/results"):
        (tmp_path / sub).mkdir(parents=True)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copy(ROOT / "docs/results/entropylong.md", tmp_path / "docs/results/entropylong.md")
    for data in (ROOT / "bench/results").glob("entropylong_*.json"):  # the page's data (truth, LoRA timing)
        shutil.copy(data, tmp_path / "bench/results" / data.name)
    page = tmp_path / "docs/results/entropylong.md"
    text = page.read_text(encoding="utf-8")
    assert docs_tables.check_docs(tmp_path, page="entropylong") == []
    digits = next(tok for tok in text.split() if tok.startswith("0.") and tok[2:5].isdigit())
    page.write_text(text.replace(digits, "0.999", 1), encoding="utf-8")
    diffs = docs_tables.check_docs(tmp_path, page="entropylong")
    assert [(d.page, d.blocks) for d in diffs] == [("docs/results/entropylong.md", ("entropylong",))]
    assert page.read_text(encoding="utf-8") != text  # --check wrote nothing
    docs_tables.generate_docs(tmp_path, page="entropylong", plots=False)
    assert page.read_text(encoding="utf-8") == text


def test_missing_result_data_is_a_clear_error_naming_the_page(tmp_path: Path, capsys) -> None:
    """A page whose committed data is gone (here the entropylong JSON) fails with an error that names the
    page and the data directory, not a traceback."""
    from longlab.cli import main

    for sub in ("docs/results", "bench/results"):
        (tmp_path / sub).mkdir(parents=True)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copy(ROOT / "docs/results/entropylong.md", tmp_path / "docs/results/entropylong.md")
    with pytest.raises(LonglabError, match="docs/results/entropylong.md: its result data under"):
        docs_tables.check_docs(tmp_path, page="entropylong")
    assert main(["report", "--docs", "--check", "--page", "entropylong", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "entropylong.md" in err and "Traceback" not in err


def test_cli_docs_check(capsys: pytest.CaptureFixture[str]) -> None:
    from longlab.cli import main

    assert main(["report", "--docs", "--check", "--page", "entropylong", str(ROOT)]) == 0
    assert "matches its data" in capsys.readouterr().out


def test_every_page_matches_its_data() -> None:
    """``longlab report --docs --check`` over every page (~15 s: bootstrap intervals of every table), in the
    default suite so that CI fails when a committed page drifts from its data."""
    diffs = check_docs(ROOT)
    assert diffs == [], "pages differ from their data (run `make results`): " + ", ".join(
        f"{d.page} ({', '.join(d.blocks)})" for d in diffs
    )


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed (docs extra)")
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """The site builds with --strict (a broken link, a missing page or a mkdocstrings failure fails)."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "load_model" in api and "paired_difference" in api  # mkdocstrings rendered the docstrings
