"""The mutation check (issue 28) as tests: every inverted selection rule in ``tests/mutation.py`` must make
its named tests fail.

``pytest -m mutation tests/test_mutations.py`` runs every mutation (minutes: one pytest run per mutation,
on a copy of ``src/``); it is kept out of the default run like ``slow``. The default run keeps two fast
checks: the table still matches the source (a snippet that moved or changed fails here, loudly, with where
it is now) and the runner refuses a missing or repeated snippet."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load():
    path = Path(__file__).with_name("mutation.py")
    spec = importlib.util.spec_from_file_location("longlab_tests_mutation", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mutation = _load()

ISSUE_28 = {"prophetkv", "dustin", "upi", "hico-drop", "hico-forward", "ultramem", "mtd-lambda"}


def test_mutation_table_matches_the_source():
    mutation.check_table()


def test_every_inversion_listed_in_issue_28_is_in_the_table():
    assert {m.name for m in mutation.MUTATIONS if m.issue} == ISSUE_28


def test_a_moved_or_repeated_snippet_fails_loudly(tmp_path):
    pkg = tmp_path / "src" / "longlab"
    (pkg / "kv").mkdir(parents=True)
    (pkg / "kv" / "moved.py").write_text("x = scores.topk(k)\ny = 1\ny = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    M, t = mutation.M, "tests/test_x.py"
    gone = M("gone", "kv/old.py", "x = scores.topk(k)", "x = (-scores).topk(k)", t)
    with pytest.raises(mutation.TableError, match="kv/old.py; the snippet is now in kv/moved.py"):
        mutation.check_table([gone], tmp_path)
    changed = M("changed", "kv/moved.py", "x = scores.argmax()", "x = 0", t)
    with pytest.raises(mutation.TableError, match="found 0 times"):
        mutation.check_table([changed], tmp_path)
    twice = M("twice", "kv/moved.py", "y = 1", "y = 2", t)
    with pytest.raises(mutation.TableError, match="found 2 times"):
        mutation.check_table([twice], tmp_path)
    untested = M("untested", "kv/moved.py", "y = 1\ny = 1", "y = 2", "tests/test_nope.py")
    with pytest.raises(mutation.TableError, match="no test file tests/test_nope.py"):
        mutation.check_table([untested], tmp_path)
    ok = M("ok", "kv/moved.py", "x = scores.topk(k)", "x = (-scores).topk(k)", t)
    mutation.check_table([ok], tmp_path)
    mutation.apply(tmp_path / "src", ok)
    assert (pkg / "kv" / "moved.py").read_text().startswith("x = (-scores).topk(k)\n")


@pytest.fixture(scope="module")
def baseline():
    mutation.check_table()
    mutation.baseline(mutation.MUTATIONS)


@pytest.mark.mutation
@pytest.mark.parametrize("m", mutation.MUTATIONS, ids=lambda m: m.name)
def test_inverted_selection_rule_is_caught(m, baseline):
    result = mutation.run_one(m)
    assert result.status == "caught", f"{m.name} ({m.module}): {result.status}: {result.detail}"
