"""Layers lab mixers: recurrent = parallel forms, causality, and each paper's reduce-to-baseline identity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longlab.lab import MIXERS, LabConfig, LabLM, Positions, mixer_config
from longlab.lab.mixers.lact import newton_schulz5
from longlab.lab.mixers.race import race_quadratic
from longlab.lab.mixers.recurrent import linear_quadratic
from longlab.recipe import LonglabError

V, D, H, T = 23, 32, 4, 24

# small chunks/windows so chunk boundaries and windows are exercised at T = 24
SPECS = {
    "softmax": "softmax:row_chunk=5",
    "ssmax": "ssmax:row_chunk=5",
    "asentmax": "asentmax:row_chunk=5",
    "lssa": "lssa:row_chunk=5",
    "lssar": "lssar:row_chunk=5",
    "race": "race:chunk=5",
    "l2a": "l2a:window=6,row_chunk=5",
    "lact": "lact:chunk=6,window=6",
    "ultramem": "ultramem:grid=6,pre=4,top_m=5,row_chunk=5",
    "linear": "linear:chunk=5",
    "mamba": "mamba:chunk=5",
    # other modalities (test_lab_modalities.py has their mechanism tests)
    "emformer": "emformer:row_chunk=5",
    "crisscross": "crisscross:channels=4",
    "vlta": "vlta:row_chunk=5",
    "ema": "ema",
    "lif": "lif:v_th=0.05",  # a low threshold: the tiny embedding makes spikes
    "ts": "ts:period=5,v_th=0.05",
}


def _model(spec: str, positions: str = "", seed: int = 0) -> LabLM:
    torch.manual_seed(seed)
    model = LabLM(LabConfig(vocab_size=V, mixer=spec, positions=positions, dim=D, n_layers=2, n_heads=H))
    for blk in model.blocks:  # routers start at g = 0.5 exactly; give them something to route
        router = getattr(blk.mixer, "router", None)
        if router is not None:
            torch.nn.init.normal_(router.weight, std=0.5)
    return model.eval().double()


def _tokens(b: int = 2, t: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_every_registered_mixer_is_covered():
    assert set(SPECS) == set(MIXERS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recurrent_form_equals_full_sequence_forward(name):
    model = _model(SPECS[name])
    if model.blocks[0].mixer.init_state(1) is None:
        pytest.skip(f"{name} has no recurrent/decode form")
    x = _tokens()
    with torch.no_grad():
        full = model(x)
        states = model.init_state(x.shape[0])
        steps = []
        for t in range(x.shape[1]):
            logits, states = model.step(x[:, t : t + 1], states)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_causal(name):
    if not MIXERS[name].causal:
        pytest.skip(f"{name} is an encoder mixer (masked pretraining)")
    model = _model(SPECS[name])
    x = _tokens()
    y = x.clone()
    y[:, 15:] = (y[:, 15:] + 1) % V
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def _mixer(spec: str, positions: str = "rope", seed: int = 0):
    torch.manual_seed(seed)
    cfg = mixer_config(spec)
    return cfg.build(D, H, Positions(positions, H, D // H, train_len=16)).double().eval()


def _x(t: int = T, seed: int = 2) -> torch.Tensor:
    return torch.randn(2, t, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _copy(dst, src):
    dst.load_state_dict(src.state_dict(), strict=False)
    return dst


def _dense_softmax(mod, x, scale_rows=None):
    """Brute-force softmax attention (full T × T matrix) with the module's projections."""
    t = x.shape[1]
    pos = torch.arange(t)
    q, k, v = mod.project(x, pos)
    if scale_rows is not None:
        q = q * scale_rows
    s = q @ k.transpose(-1, -2) / math.sqrt(mod.head_dim)
    bias = mod.positions.bias(pos, pos)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    out = torch.softmax(s, -1) @ v
    return mod.o(out.transpose(1, 2).reshape(x.shape[0], t, D))


@pytest.mark.parametrize("positions", ["rope", "nope", "alibi", "nape", "ropeid"])
def test_softmax_sdpa_equals_brute_force(positions):
    mod = _mixer("softmax:row_chunk=7", positions)
    x = _x()
    torch.testing.assert_close(mod(x), _dense_softmax(mod, x))
    mod.use_sdpa = False  # the generic row-chunked path with weights() = softmax
    torch.testing.assert_close(mod(x), _dense_softmax(mod, x))


def test_ssmax_with_unit_scale_is_softmax_and_follows_its_formula():
    ss = _mixer("ssmax:row_chunk=7")
    ref = _copy(_mixer("softmax"), ss)
    x = _x()
    with torch.no_grad():
        ss.s.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
    # s·log n per row, brute force: softmax((s·log(i+2))·z)
    rows = (ss.s[:, None] * torch.log(torch.arange(T, dtype=torch.float64) + 2))[None, :, :, None]
    torch.testing.assert_close(ss(x), _dense_softmax(ss, x, rows))
    ss.length_scale = lambda q_pos, xq: torch.ones(1, H, q_pos.shape[0], 1, dtype=torch.float64)
    torch.testing.assert_close(ss(x), ref(x))  # s·log n = 1 -> softmax


def test_asentmax_alpha_one_unit_scale_is_softmax():
    ase = _mixer("asentmax:alpha=1,adaptive=false,row_chunk=7", "nape")
    ref = _copy(_mixer("softmax", "nape"), ase)
    x = _x()
    torch.testing.assert_close(ase(x), ref(x))
    near = _copy(_mixer("asentmax:alpha=1.0001,adaptive=false", "nape"), ase)  # entmax_bisect near α = 1
    torch.testing.assert_close(near(x), ref(x), rtol=0, atol=5e-3)


def test_asentmax_weights_are_sparse_distributions_with_adaptive_scale():
    ase = _mixer("asentmax:alpha=1.5", "nape")
    x = _x()
    pos = torch.arange(T)
    q, k, v = ase.project(x, pos)
    q, k = ase.prepare(q, k, pos, x)
    s = (q @ k.transpose(-1, -2)) * ase.score_scale() + ase.positions.bias(pos, pos)
    valid = ase.visible(pos, pos)
    w = ase.weights(s.masked_fill(~valid, -1e30), valid, pos, x)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    assert float((w[..., ~valid] == 0).float().mean()) == 1.0
    assert float((w[..., valid] == 0).float().mean()) > 0.05  # entmax gives exact zeros
    # the length scale multiplies only the NoPE heads (NAPE: heads 0-1 ALiBi, 2-3 NoPE)
    scale = ase.length_scale(pos, x)
    assert torch.all(scale > 1)
    q0, _, _ = ase.project(x, pos)
    torch.testing.assert_close(q[:, :2], q0[:, :2])
    torch.testing.assert_close(q[:, 2:], q0[:, 2:] * scale[:, 2:])


def _lssa_brute(mod, x, p=None, shift=True, free_rows=3):
    t = x.shape[1]
    pos = torch.arange(t)
    q, k, v = mod.project(x, pos)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    n = torch.arange(1, t + 1, dtype=torch.float64)[:, None]
    s = math.log(mod.head_dim) * torch.log(n) * (q @ k.transpose(-1, -2))
    m = torch.ones(t, t, dtype=torch.float64).tril()
    a = F.softplus(s) * m
    a = a / (a.sum(-1, keepdim=True) + 1e-8)
    if p is not None:
        o = torch.ones(t, 1, dtype=torch.float64) if shift else torch.zeros(t, 1, dtype=torch.float64)
        o[:free_rows] = 0
        a = F.relu(a * n - o) ** p
        a = a / (a.sum(-1, keepdim=True) + 1e-8)
    out = a @ v
    return mod.o(out.transpose(1, 2).reshape(x.shape[0], t, D))


def test_lssa_and_lssar_match_the_paper_formulas_row_chunked():
    x = _x()
    lssa = _mixer("lssa:row_chunk=5")
    torch.testing.assert_close(lssa(x), _lssa_brute(lssa, x))
    lssar = _copy(_mixer("lssar:p=3,row_chunk=5"), lssa)
    # the module takes the power of A / max_row(A) (no overflow at p = 15), so its ε = 1e-8 acts on the
    # max-normalised row: equal to the direct formula up to that ε
    torch.testing.assert_close(lssar(x), _lssa_brute(lssar, x, p=3.0), rtol=1e-4, atol=1e-5)


def test_lssar_p1_without_shift_is_lssa():
    x = _x()
    lssa = _mixer("lssa")
    lssar = _copy(_mixer("lssar:p=1,shift=false"), lssa)
    torch.testing.assert_close(lssar(x), lssa(x))


def test_lssar_p15_stays_finite_at_long_rows_and_memory_is_row_chunked():
    mod = _mixer("lssar:row_chunk=32").float()
    x = _x(t=600).float()
    out = mod(x)
    assert torch.isfinite(out).all()
    seen = []
    orig = mod.weights
    mod.weights = lambda s, *a: (seen.append(tuple(s.shape)), orig(s, *a))[1]
    mod(x)
    assert max(s[-2] for s in seen) == 32 and max(s[-1] for s in seen) == 600  # never 600 × 600


def test_race_prefix_scan_equals_quadratic_form():
    mod = _mixer("race:chunk=5,tables=3,bits=3")
    with torch.no_grad():
        mod.log_temp.fill_(-1.5)
    x = _x()
    torch.testing.assert_close(mod(x), race_quadratic(mod, x))


def test_linear_attention_scan_equals_quadratic_form():
    mod = _mixer("linear:chunk=5", "nope")
    x = _x()
    torch.testing.assert_close(mod(x), linear_quadratic(mod, x))


def test_mamba_scan_equals_chunked_parallel_form():
    mod = _mixer("mamba:chunk=5", "nope")
    x = _x()
    torch.testing.assert_close(mod(x), mod.forward_chunked(x))


def test_l2a_gate_one_everywhere_is_global_attention():
    mod = _mixer("l2a:window=4")
    ref = _copy(_mixer("softmax"), mod)
    mod.gate = lambda x: torch.ones(x.shape[:2], dtype=x.dtype)
    x = _x()
    torch.testing.assert_close(mod(x), ref(x))
    assert mod.last_rate == 1.0


def test_l2a_gather_equals_dense_routing_and_costs_scale_with_rate():
    mod = _mixer("l2a:window=4")
    torch.nn.init.normal_(mod.router.weight, std=1.0)
    x = _x()
    gathered = mod(x)  # eval: a real gather of the routed queries
    rate = mod.last_rate
    assert 0.1 < rate < 0.9
    calls = []
    orig = mod._global
    mod._global = lambda q, *a: (calls.append(q.shape[2]), orig(q, *a))[1]
    mod(x)
    assert sum(calls) == round(rate * x.shape[0] * T)  # global attention only for routed queries
    mod._global = orig
    mod.train()
    dense = mod(x)
    torch.testing.assert_close(dense, gathered)
    assert mod.aux_loss is not None and mod.aux_loss.requires_grad
    dense.sum().backward()
    assert mod.router.weight.grad is not None and mod.router.weight.grad.abs().sum() > 0  # STE


def test_l2a_rate_loss_soft_vs_hard():
    """The default rate term uses the soft gate; ``hard_rate`` uses the STE gate, whose value is the routed
    fraction (so gates parked just below τ no longer satisfy it)."""
    x = _x()
    for hard in (False, True):
        mod = _mixer(f"l2a:window=4,hard_rate={'true' if hard else 'false'}").train()
        torch.nn.init.zeros_(mod.router.weight)
        torch.nn.init.constant_(mod.router.bias, math.log(0.2 / 0.8))  # every gate 0.2 < τ: nothing routed
        mod(x)
        assert mod.last_rate == 0.0
        want = (0.0 - 0.2) ** 2 if hard else (0.2 - 0.2) ** 2
        assert float(mod.aux_loss.detach()) == pytest.approx(want, abs=1e-12)
        mod.aux_loss.backward()
        grad = float(mod.router.bias.grad)
        assert (grad < 0) if hard else grad == pytest.approx(0.0, abs=1e-12)  # hard: pushes gates up


def test_lact_update_is_the_gradient_of_the_chunk_loss():
    mod = _mixer("lact:chunk=6,window=6")
    b, c = 2, 6
    g = torch.Generator().manual_seed(3)
    kt = F.normalize(torch.randn(b, mod.fh, c, mod.dk, generator=g, dtype=torch.float64), dim=-1)
    vt = torch.randn(b, mod.fh, c, mod.dk, generator=g, dtype=torch.float64)
    eta = torch.rand(b, mod.fh, c, 3, generator=g, dtype=torch.float64)
    w = [p.detach()[None].expand(b, *p.shape).clone().requires_grad_(True) for p in (mod.w0, mod.w1, mod.w2)]
    # ℒ = −Σ_i η_i ⟨f_W(k_i), v_i⟩ with a separate η per weight: differentiate each weight's term
    grads = []
    for j in range(3):
        f = mod.apply_fast(w, kt)
        loss = -(eta[..., j : j + 1] * f * vt).sum()
        grads.append(torch.autograd.grad(loss, w[j])[0])
    w0, w1, w2 = (p.detach() for p in w)
    new, _ = mod.update((w0, w1, w2), None, kt, vt, eta, None)  # analytic update, then row-norm rescale
    for wi, ni, gi, init in zip((w0, w1, w2), new, grads, (mod.w0, mod.w1, mod.w2)):
        expected = wi - gi  # W + ΔW with ΔW = −∂ℒ/∂W
        expected = expected / (expected.norm(dim=-1, keepdim=True) + 1e-6) * init.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(ni, expected)


def test_lact_apply_then_update_first_chunk_uses_initial_weights():
    mod = _mixer("lact:chunk=6,window=6")
    x = _x()
    y = x.clone()
    y[:, 6:] = torch.randn_like(y[:, 6:])
    torch.testing.assert_close(mod(x)[:, :6], mod(y)[:, :6])
    assert not torch.allclose(mod(x)[:, 6:12], mod(y)[:, 6:12])


def test_newton_schulz5_orthogonalises():
    g = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sv = torch.linalg.svdvals(newton_schulz5(g))
    assert float(sv.min()) > 0.5 and float(sv.max()) < 1.3


def test_lact_muon_and_momentum_forms_still_agree():
    model = _model("lact:chunk=6,window=6,muon=true,momentum=true")
    x = _tokens()
    with torch.no_grad():
        full = model(x)
        steps = []
        st = model.init_state(2)
        for t in range(T):
            out, st = model.step(x[:, t : t + 1], st)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-7, atol=1e-7)


def test_ultramem_preselection_with_full_grid_is_exact_top_m():
    mod = _mixer("ultramem:grid=6,pre=6,top_m=5")
    mem = mod.parallel_ffn
    x = _x()
    s_row, s_col = mem.scores(x)
    grid = mem.grid_scores(s_row, s_col).flatten(-2)  # [B, T, h, h, n²]
    top, slot = grid.topk(mem.m, dim=-1)
    expected = mem.out(((torch.softmax(top, -1)[..., None]) * mem.values[slot]).sum(-2).reshape(2, T, -1))
    torch.testing.assert_close(mem(x), expected)


def test_ultramem_without_memory_is_softmax():
    mod = _mixer("ultramem")
    ref = _copy(_mixer("softmax"), mod)
    x = _x()
    torch.testing.assert_close(mod(x), ref(x))  # the token mixer itself is softmax attention
    assert mod.parallel_ffn is not None


@pytest.mark.parametrize(
    "spec, match",
    [
        ("nosuch", "unknown mixer"),
        ("lssar:p=0", "p must be"),
        ("lssar:p=-2", "p must be"),
        ("asentmax:alpha=0.5", "alpha must be"),
        ("race:bits=0", "bits"),
        ("softmax:foo=1", "no parameter"),
        ("l2a:rate=1.5", "rate"),
    ],
)
def test_bad_mixer_specs(spec, match):
    with pytest.raises(LonglabError, match=match):
        mixer_config(spec)


def test_ropeid_rotates_a_quarter_of_the_channels_at_its_frequencies():
    from longlab.position.rope import ropeid_inv_freq

    d, L = 16, 64
    pos = Positions("ropeid", 2, d, train_len=L)
    inv = ropeid_inv_freq(d, L, 1.0)  # [8]: 4 rotated pairs, 4 NoPE pairs
    assert inv[0] == 1.0 and math.isclose(float(inv[3]) * L, 2 * math.pi, rel_tol=1e-6)
    assert (inv[4:] == 0).all()
    x = torch.randn(1, 2, 6, d, dtype=torch.float64)
    t = torch.arange(6)
    out = pos.rotate(x, t)
    torch.testing.assert_close(out[..., 8:], x[..., 8:])  # channels 8..15: NoPE, untouched
    for i in range(4):  # pair i = channels (2i, 2i+1), angle t·ω_i, by hand
        c, s = torch.cos(t * float(inv[i])).double(), torch.sin(t * float(inv[i])).double()
        torch.testing.assert_close(out[..., 2 * i], x[..., 2 * i] * c - x[..., 2 * i + 1] * s)
        torch.testing.assert_close(out[..., 2 * i + 1], x[..., 2 * i] * s + x[..., 2 * i + 1] * c)
    # scores depend on the offset only: q at 5, k at 2 equals q at 13, k at 10
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    def score(a, b):
        return pos.rotate(q.view(1, 1, 1, d), torch.tensor([a])).flatten() @ pos.rotate(
            k.view(1, 1, 1, d), torch.tensor([b])).flatten()
    torch.testing.assert_close(score(5, 2), score(13, 10))
    with pytest.raises(LonglabError, match="ropeid needs"):
        Positions("ropeid", 2, d)  # no training length


def test_positions_a_mixer_cannot_take():
    with pytest.raises(LonglabError, match="positions"):
        LabConfig(vocab_size=V, mixer="mamba", positions="rope")
    with pytest.raises(LonglabError, match="positions"):
        LabConfig(vocab_size=V, mixer="race", positions="alibi")
    with pytest.raises(LonglabError, match="positions"):
        LabConfig(vocab_size=V, mixer="softmax", positions="sinusoid")
