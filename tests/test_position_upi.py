"""UPI on the small pure-PyTorch hybrid: the closed-form gates (n small steps = one original step; n = 1
changes nothing), the ERF metric against a brute-force unrolling, head selection, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.models import build_tiny_model
from longlab.position import apply_position
from longlab.position.upi import HybridConfig, HybridLM, Mamba2Mixer, erf_mmd, ssm_step, upi_gates
from longlab.recipe import LonglabError


@pytest.mark.parametrize("n", [1, 2, 4, 8, 3.5])
def test_n_small_steps_equal_one_original_step(n):
    torch.manual_seed(0)
    a = torch.tensor([0.01, 0.5, 3.0, 20.0])  # [H]: slow to fast decay
    dt = torch.tensor([[0.001, 0.1, 0.7, 2.0]], dtype=torch.float64)  # [B, H]
    h = torch.randn(1, 4, 3, 5, dtype=torch.float64)
    bx = torch.randn(1, 4, 3, 5, dtype=torch.float64)
    one = ssm_step(h, a.double(), dt, bx)  # exp(-aΔ)·h + Δ·bx
    small = h
    steps = int(n) if float(n).is_integer() else None
    if steps is None:  # a fractional n: the closed form still has the right fixed point and decay
        f, g = upi_gates(a.double() * dt, dt, n)
        assert torch.allclose(f**n, torch.exp(-a.double() * dt))
        return
    for _ in range(steps):  # the input held for n small steps
        small = ssm_step(small, a.double(), dt, bx, n=n, mode="exact")
    assert torch.allclose(small, one, atol=1e-12)


def test_n1_changes_nothing_and_dt_rule_is_the_small_a_limit():
    a, dt = torch.tensor([1e-9, 0.3]), torch.tensor([[0.05, 0.05]])
    f, g = upi_gates(a * dt, dt, 1.0)
    assert torch.equal(f, torch.exp(-a * dt)) and torch.allclose(g, dt)
    f, g = upi_gates(a * dt, dt, 4.0)
    assert g[0, 0].item() == pytest.approx(0.05 / 4, rel=1e-6)  # aΔ -> 0: g = Δ/n
    assert g[0, 1].item() != pytest.approx(0.05 / 4, rel=1e-3)  # otherwise the exact gate differs
    torch.manual_seed(0)
    model = HybridLM(HybridConfig())
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        want = model(ids)
        apply_position(model, "upi:factor=1")  # n = 1: Δ/1 on the chosen heads, no YaRN
        assert torch.equal(model(ids), want)


def test_erf_mmd_matches_brute_force():
    torch.manual_seed(1)
    mixer = Mamba2Mixer(16, 2, 4, 3)
    x = torch.randn(1, 12, 16)
    _, (dt, bm, cm) = mixer(x, return_dt=True)
    a = torch.exp(mixer.a_log).detach()
    L = 11  # last token, 0-based
    for h in range(2):
        m = []
        for j in range(L + 1):
            decay = math.prod(math.exp(-a[h].item() * dt[0, k, h].item()) for k in range(j + 1, L + 1))
            m.append(abs((cm[0, L] @ bm[0, j]).item() * dt[0, j, h].item() * decay))
        want = sum((L - j) * v for j, v in enumerate(m)) / sum(m)
        assert erf_mmd(mixer, x)[h].item() == pytest.approx(want, rel=1e-4)


def test_upi_scales_the_top_heads_and_yarn():
    torch.manual_seed(0)
    model = HybridLM(HybridConfig(layers="MAMAM", n_heads=5))  # 15 Mamba heads: top 20% = 3
    inv = model.mixers[1].inv_freq.clone()
    method = apply_position(model, "upi:factor=4")
    assert method.name == "upi" and model.longlab_position is method
    scales = torch.cat([model.mixers[i].dt_scale for i in (0, 2, 4)])
    assert int((scales == 4).sum()) == 3 and int((scales == 1).sum()) == 12
    assert not torch.equal(model.mixers[1].inv_freq, inv)  # YaRN on the attention layers
    assert model.mixers[1].attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    every = HybridLM(HybridConfig(layers="MAMAM", n_heads=5))
    apply_position(every, "upi:factor=4,heads=all,yarn=false")
    assert all(bool((every.mixers[i].dt_scale == 4).all()) for i in (0, 2, 4))


def test_upi_bad_input():
    with pytest.raises(LonglabError, match=r"factor must be in \[1, 1024\]"):
        apply_position(HybridLM(HybridConfig()), "upi:factor=0.5")
    with pytest.raises(LonglabError, match="hybrid"):
        apply_position(build_tiny_model("tiny-llama"), "upi:factor=2")
    with pytest.raises(LonglabError, match="does not apply to the hybrid"):
        apply_position(HybridLM(HybridConfig()), "yarn:factor=2")


@pytest.mark.parametrize("mode", ["dt", "exact"])
def test_parallel_scan_equals_the_recurrence(mode):
    """The quadratic (SSD) form the model trains with reproduces the sequential loop, Δ-scaled heads too."""
    torch.manual_seed(2)
    mixer = Mamba2Mixer(16, 4, 4, 3).double()
    mixer.mode = mode
    mixer.dt_scale = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    x = torch.randn(2, 37, 16, dtype=torch.float64)
    mixer.scan = "loop"
    want = mixer(x)
    mixer.scan = "parallel"
    assert torch.allclose(mixer(x), want, atol=1e-10)
