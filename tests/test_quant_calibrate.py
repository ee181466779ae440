"""PM-KVQ calibration: the integer program by hand, and the whole pipeline on a tiny model."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from longlab.cli.calibrate import add_calibrate_arguments
from longlab.generation import generate
from longlab.quant import QuantizedLayer
from longlab.quant.calibrate import calibrate_pmkvq, fake_quant, solve_allocation
from longlab.quant.pmkvq import layer_bytes
from longlab.recipe import LonglabError


def test_integer_program_spends_memory_where_sensitivity_is_highest():
    # Options per layer: 8 bits (2 MB) or 2 bits (1 MB); 5 MB for 3 layers buys two upgrades.
    cost = np.array([[0.0, 5.0], [0.0, 1.0], [0.0, 9.0]])  # error at [8 bits, 2 bits]
    memory = np.array([[2.0, 1.0]] * 3)
    assert solve_allocation(cost, memory, 5.0).tolist() == [0, 1, 0]  # keep 8 bits where the loss is worst
    assert solve_allocation(cost, memory, 3.0).tolist() == [1, 1, 1]
    assert solve_allocation(cost, memory, 6.0).tolist() == [0, 0, 0]
    with pytest.raises(LonglabError, match="below the smallest allocation"):
        solve_allocation(cost, memory, 2.5)


def test_smoothing_is_exact_in_full_precision_and_helps_outlier_channels():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 64, 32, generator=g)
    k[..., 5] *= 30  # an outlier channel stretches every per-token group
    lam = k.abs().amax(2, keepdim=True).clamp_min(1e-5) ** 0.5  # [1, H, 1, D]
    assert torch.allclose(fake_quant(k, 16, 32, torch.float32, lam), k, atol=1e-3)
    plain = (fake_quant(k, 4, 32) - k).pow(2).mean()
    smoothed = (fake_quant(k, 4, 32, lam=lam) - k).pow(2).mean()
    assert smoothed < plain


def test_calibration_end_to_end_on_tiny_llama(llama, tokenizer, text, tmp_path):
    budget_mb = 2 * layer_bytes(700, 4, 2, 16, smooth=True) / 2**20  # room for 4 bits in both layers
    alloc = calibrate_pmkvq(
        llama,
        tokenizer,
        budget_mb,
        bits_choices=(8, 4, 2),
        max_tokens=700,
        num_samples=2,
        sample_tokens=96,
        target_tokens=384,
        log=lambda *a: None,
    )
    assert alloc["calibration"]["position_stride"] == 4
    assert len(alloc["layers"]) == 2 and alloc["used_mb"] <= budget_mb
    for entry in alloc["layers"]:
        sk = [entry["sensitivity_k"][b] for b in ("16", "8", "4", "2", "1")]
        assert sk[0] < sk[2] < sk[4]  # fewer bits, more sensitivity
        assert entry["bits"] in (8, 4, 2)
    assert llama.config._attn_implementation == "longlab"  # restored
    path = tmp_path / "alloc.json"
    path.write_text(json.dumps(alloc))
    result = generate(llama, tokenizer, text[:600], "Where?", f"pmkvq:allocation={path}", max_new_tokens=4)
    for layer, entry in zip(result.cache.layers, alloc["layers"]):
        assert isinstance(layer, QuantizedLayer)
        assert layer.code_nbytes() <= entry["budget_bytes"]  # PM-KVQ's budget counts code words
    with pytest.raises(LonglabError, match="calibrated with"):
        generate(
            llama, tokenizer, text[:600], "Where?", f"pmkvq:allocation={path},window=64", max_new_tokens=2
        )


def test_cli_arguments_parse():
    args = add_calibrate_arguments(argparse.ArgumentParser()).parse_args(
        ["pmkvq", "--model", "tiny-llama", "--budget-mb", "8", "--bits", "4,2"]
    )
    assert (args.method, args.model, args.budget_mb, args.bits, args.max_tokens) == (
        "pmkvq",
        "tiny-llama",
        8.0,
        "4,2",
        4096,
    )


# ---------------------------------------------------------- issue 10 item 11: arguments the recipe refuses
@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--window", "-5", ("--window", "window must be an integer in [1, 1048576], got -5")),
        ("--sink", "-1", ("--sink", "sink must be an integer in [0, 1048576], got -1")),
        ("--budget-mb", "nan", ("--budget-mb", "budget_mb must be a finite number in (0, 1048576], got nan")),
        ("--budget-mb", "0", ("--budget-mb", "budget_mb must be in (0, 1048576], got 0")),
        ("--samples", "0", ("--samples must be an integer in [1, 4096], got 0",)),
        ("--sample-tokens", "0", ("--sample-tokens must be an integer in [1, 1048576]",)),
        ("--target-tokens", str(10**12), ("--target-tokens must be an integer in [1, 1048576]",)),
        ("--max-tokens", "0", ("--max-tokens must be an integer in [1, 1048576]",)),
        ("--target-tokens", "0", ("--target-tokens must be an integer in [1, 1048576]",)),
        ("--bits", "4,3", ("--bits must be among 16, 8, 4, 2",)),
        ("--seed", "99999999999", ("--seed must be an integer in [0, 4294967295]",)),
    ],
)
def test_calibrate_refuses_what_the_recipe_would_refuse_before_any_work(flag, value, words, tmp_path, capsys):
    from longlab.cli import main as cli_main

    out = tmp_path / "alloc.json"
    argv = ["calibrate", "pmkvq", "--model", "no-such-model-is-loaded", "--budget-mb", "1", "--out", str(out)]
    assert cli_main(argv + [flag, value]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert "Traceback" not in err and not out.exists()


def test_calibrate_window_range_is_the_recipes(llama, tokenizer):
    # the same value fails the same check in the recipe that would read the file and in the API
    with pytest.raises(LonglabError, match=r"^pmkvq: window must be an integer in \[1, 1048576\], got -5$"):
        calibrate_pmkvq(llama, tokenizer, 1.0, window=-5, log=lambda *a: None)
    with pytest.raises(LonglabError, match=r"pmkvq: window must be an integer in \[1, 1048576\], got -5"):
        from longlab.recipe import parse_recipe

        parse_recipe("pmkvq:budget_mb=1,window=-5")
    assert llama.config._attn_implementation == "longlab"


def test_calibrate_out_must_be_a_writable_file(tmp_path, capsys):
    from longlab.cli import main as cli_main

    argv = ["calibrate", "pmkvq", "--model", "no-such-model-is-loaded", "--budget-mb", "1", "--out"]
    assert cli_main(argv + [str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli_main(argv + [str(blocker / "alloc.json")]) == 2
    assert "which is a file" in capsys.readouterr().err
