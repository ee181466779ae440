"""Position methods: cos/sin tables and attention factors against the formulas of the spec (computed here,
independently, in float64), for Llama-, Qwen2- and Gemma3-style tiny models; bad input."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.models import build_tiny_model, load_model
from longlab.position import (
    POSITIONS,
    apply_position,
    format_position,
    parse_position,
    rope_tables,
    use_position,
)
from longlab.recipe import LonglabError

L = 8192  # the tiny models' max_position_embeddings
D = 16  # their head_dim
STYLES = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")


def _theta(base: float, dim: int = D) -> torch.Tensor:
    return base ** (-2 * torch.arange(dim // 2, dtype=torch.float64) / dim)  # θ_i = b^{-2i/D}


def _table(inv: torch.Tensor, pos: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    ang = pos.double()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)  # rotate-half layout: pair i is channels i and i + D/2
    return scale * ang.cos(), scale * ang.sin()


def _base_of(name: str) -> float:
    return 1e6 if name == "tiny-gemma3" else 1e4  # the full-attention layers' theta


def _layer_type(name: str) -> str | None:
    return "full_attention" if name == "tiny-gemma3" else None


def _yarn_code(base: float, s: float, beta_fast: float = 32, beta_slow: float = 1) -> torch.Tensor:
    """The authors' code (jquesnelle/yarn): γ linear in the pair index between the correction dims."""
    dim_of = lambda rot: D * math.log(L / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), D - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(D // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    theta = _theta(base)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    return theta / s * (1 - keep) + theta * keep


def _yarn_paper(base: float, s: float, alpha: float = 1, beta: float = 32) -> torch.Tensor:
    """The spec / paper: r_i = L/λ_i, γ(r) = clip((r-α)/(β-α), 0, 1), θ' = (1-γ)θ/s + γθ."""
    theta = _theta(base)
    r = L / (2 * math.pi / theta)
    gamma = ((r - alpha) / (beta - alpha)).clamp(0, 1)
    return (1 - gamma) * theta / s + gamma * theta


POS = torch.tensor([0, 1, 7, 100, 4095, 8191, 12000, 20000, 32767])


def _expected(spec: str, base: float) -> tuple[torch.Tensor, float]:
    """(θ' [D/2], cos/sin multiplier) by the spec's formulas."""
    s = 4.0
    theta = _theta(base)
    if spec == "pi:factor=4":
        return theta / s, 1.0
    if spec == "ntk:factor=4":
        return _theta(base * s ** (D / (D - 2))), 1.0
    if spec == "yarn:factor=4":
        return _yarn_code(base, s), 0.1 * math.log(s) + 1
    if spec == "yarn:factor=4,ramp=paper":
        return _yarn_paper(base, s), 0.1 * math.log(s) + 1
    if spec == "yarn:factor=8,beta_fast=16,attention_factor=1.5":
        return _yarn_code(base, 8.0, beta_fast=16), 1.5
    if spec == "longrope:factor=4":
        lam = torch.tensor([s ** (2 * i / (D - 2)) for i in range(D // 2)], dtype=torch.float64)
        return theta / lam, math.sqrt(1 + math.log(s) / math.log(L))
    if spec == "longrope:factor=4,init=pi":
        return theta / s, math.sqrt(1 + math.log(s) / math.log(L))
    if spec == "drope":
        return torch.zeros(D // 2, dtype=torch.float64), 1.0
    raise AssertionError(spec)


SPECS = (
    "pi:factor=4",
    "ntk:factor=4",
    "yarn:factor=4",
    "yarn:factor=4,ramp=paper",
    "yarn:factor=8,beta_fast=16,attention_factor=1.5",
    "longrope:factor=4",
    "longrope:factor=4,init=pi",
    "drope",
)


@pytest.mark.parametrize("name", STYLES)
@pytest.mark.parametrize("spec", SPECS)
def test_tables_match_spec_formulas(name, spec):
    model = build_tiny_model(name)
    lt = _layer_type(name)
    before = rope_tables(model, POS, "sliding_attention") if lt else None
    apply_position(model, spec)
    inv, scale = _expected(spec, _base_of(name))
    cos, sin = rope_tables(model, POS, lt)
    want_cos, want_sin = _table(inv, POS, scale)
    # float32 angles (as transformers computes them) at positions up to 32k: |Δangle| <= ~4e-3
    assert torch.allclose(cos.double(), want_cos, atol=5e-3), (cos.double() - want_cos).abs().max()
    assert torch.allclose(sin.double(), want_sin, atol=5e-3)
    assert cos[0].double().sub(scale).abs().max() < 1e-6  # position 0: cos = attention factor exactly
    if lt:
        after = rope_tables(model, POS, "sliding_attention")
        if spec == "drope":  # DroPE drops RoPE in every layer
            assert torch.equal(after[0], torch.ones_like(after[0])) and torch.equal(
                after[1], torch.zeros_like(after[1])
            )
        else:  # the sliding layers keep their own RoPE, bit for bit
            assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


@pytest.mark.parametrize("name", STYLES)
def test_dynamic_ntk_base_grows_with_length(name):
    model = build_tiny_model(name)
    apply_position(model, "dynamic-ntk:factor=4")
    lt, base = _layer_type(name), _base_of(name)
    short = torch.arange(0, 1000)
    cos, _ = rope_tables(model, short, lt)
    assert torch.allclose(cos.double(), _table(_theta(base), short)[0], atol=1e-4)  # ℓ <= L: plain RoPE
    ell = 2 * L
    pos = torch.arange(ell)
    cos, sin = rope_tables(model, pos, lt)
    b2 = base * (4 * ell / L - 3) ** (D / (D - 2))  # b' = b·(s·ℓ/L - (s-1))^{D/(D-2)}
    want_cos, want_sin = _table(_theta(b2), pos)
    assert torch.allclose(cos.double(), want_cos, atol=5e-3) and torch.allclose(
        sin.double(), want_sin, atol=5e-3
    )


@pytest.mark.parametrize("name", STYLES)
def test_ropeid_table(name):
    model = build_tiny_model(name)
    apply_position(model, "ropeid:cycles=2,train_len=1024")
    cos, sin = rope_tables(model, POS, _layer_type(name))
    P = D // 4  # rotated pairs: channels 0..D/4-1 and D/2..3D/4-1 (quarters 1 and 3)
    omega = (2 * math.pi * 2 / 1024) ** (torch.arange(P, dtype=torch.float64) / (P - 1))
    assert omega[0] == 1.0 and all(
        omega * 1024 / (2 * math.pi) >= 2 - 1e-9
    )  # every pair: >= c turns in L_train
    inv = torch.cat((omega, torch.zeros(D // 2 - P, dtype=torch.float64)))
    want_cos, want_sin = _table(inv, POS)
    assert torch.allclose(cos.double(), want_cos, atol=5e-3) and torch.allclose(
        sin.double(), want_sin, atol=5e-3
    )
    for q in (slice(D // 4, D // 2), slice(3 * D // 4, D)):  # quarters 2 and 4: NoPE
        assert torch.equal(cos[:, q], torch.ones_like(cos[:, q])) and torch.equal(
            sin[:, q], torch.zeros_like(sin[:, q])
        )
    model2 = build_tiny_model(name)
    apply_position(model2, "ropeid:train_len=1024,temp_len=8192")
    tau = math.log(8192) / math.log(1024)  # logit temperature: cos, sin × sqrt(τ)
    assert rope_tables(model2, torch.tensor([0]), _layer_type(name))[0][0, 0].item() == pytest.approx(
        math.sqrt(tau)
    )


@pytest.mark.parametrize("name", ("tiny-llama", "tiny-qwen2"))
@pytest.mark.parametrize(
    "spec,params",
    [
        ("pi:factor=4", {"rope_type": "linear", "factor": 4.0}),
        ("yarn:factor=4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L}),
        ("dynamic-ntk:factor=2", {"rope_type": "dynamic", "factor": 2.0}),
    ],
)
def test_logits_equal_a_model_built_with_those_rope_parameters(name, spec, params, tokenizer):
    """The method reaches the model through its rope parameters: same logits as transformers' own model
    constructed with them (same seed, so the same weights)."""
    ids = torch.tensor([tokenizer.encode("position interpolation " * 6)])
    ref = build_tiny_model(name, rope_parameters={"rope_theta": 1e4, **params})
    model = build_tiny_model(name)
    apply_position(model, spec)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_use_position_restores_the_model(tokenizer):
    model = build_tiny_model("tiny-gemma3")
    ids = torch.tensor([tokenizer.encode("hello world, " * 8)])
    with torch.no_grad():
        base = model(ids).logits
        with use_position(model, "drope:qk_norm=true") as method:
            assert method.name == "drope"
            assert not torch.allclose(model(ids).logits, base)
        assert torch.equal(model(ids).logits, base)
        assert model.config.rope_parameters["full_attention"]["rope_type"] == "default"
        assert not hasattr(model.model.layers[0].self_attn, "longlab_q_norm")


def test_load_model_position_and_format():
    model, _ = load_model("tiny-llama", position="yarn:factor=4,ramp=paper")
    assert model.longlab_position.spec == "yarn:ramp=paper"  # factor 4 is the default
    assert format_position(parse_position("pi:factor=8")) == "pi:factor=8"
    assert parse_position("none") is None and parse_position(None) is None
    assert set(POSITIONS) >= {"pi", "ntk", "dynamic-ntk", "yarn", "longrope", "drope", "ropeid", "repo"}
    for name, cls in POSITIONS.items():
        assert cls.paper, name  # every method cites its paper


@pytest.mark.parametrize(
    "spec,words",
    [
        ("yarn:factor=0", r"factor must be in \[1, 1024\]"),
        ("pi:factor=-2", r"factor must be in \[1, 1024\]"),
        ("ntk:factor=0.5", r"factor must be in \[1, 1024\]"),
        ("dynamic-ntk:factor=abc", "factor must be"),
        ("longrope:factor=2,init=magic", "init must be"),
        ("yarn:beta_fast=1,beta_slow=2", "beta_fast must be > beta_slow"),
        ("yarn:ramp=linear", "ramp must be"),
        ("yarn:original=-5", "original"),
        ("ropeid:cycles=0", "cycles"),
        ("ropeid:cycles=5000,train_len=1024", "cycles"),
        ("warp:factor=2", "unknown position method"),
        ("pi:scale=2", "has no parameter scale"),
        ("repo:start=99", "start=99"),
    ],
)
def test_bad_input(spec, words):
    with pytest.raises(LonglabError, match=words):
        load_model("tiny-llama", position=spec)


def test_model_without_rope_and_double_apply():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=64))
    with pytest.raises(LonglabError, match="no rotary embedding"):
        apply_position(gpt2, "yarn:factor=2")
    model = build_tiny_model("tiny-llama")
    apply_position(model, "pi:factor=2")
    with pytest.raises(LonglabError, match="already has position method"):
        apply_position(model, "ntk:factor=2")
    with pytest.raises(LonglabError, match="position must be a string"):
        apply_position(model, 4)


def test_yarn_ramps_differ_on_smollm2_shape():
    """The paper's ramp (linear in turns r) and the code's (linear in pair index) give different tables for
    SmolLM2's rope (b = 1e5, D = 64, L = 8192): the one place the two YaRNs disagree."""
    from longlab.position.rope import yarn_paper_inv_freq

    paper = yarn_paper_inv_freq(1e5, 64, 4.0, 8192, 1.0, 32.0).double()
    theta = 1e5 ** (-2 * torch.arange(32, dtype=torch.float64) / 64)
    assert torch.allclose(paper[:3], theta[:3])  # fastest pairs: r > 32, kept
    assert torch.allclose(paper[-3:], theta[-3:] / 4)  # slowest pairs: r < 1, interpolated by s
    model = build_tiny_model("tiny-llama", head_dim=64, hidden_size=128, rope_parameters={"rope_theta": 1e5})
    apply_position(model, "yarn:factor=4")
    code = model.model.rotary_emb.inv_freq.double()
    assert (code - paper).abs().max() / theta.max() > 1e-3


def _chunked_vs_one_shot(model, ids: torch.Tensor, chunk: int, cache_kind: str) -> list[float]:
    """Max |logit difference| per chunk between a one-shot forward and a chunked prefill through a cache."""
    from transformers import DynamicCache

    from longlab.cache import LonglabCache

    with torch.no_grad():
        one = model(ids).logits
        cache = DynamicCache(config=model.config) if cache_kind == "dynamic" else LonglabCache("full")
        outs = [
            model(
                input_ids=ids[:, s : s + chunk],
                position_ids=torch.arange(s, min(s + chunk, ids.shape[1]))[None],
                cache=cache,
                use_cache=True,
            ).logits
            for s in range(0, ids.shape[1], chunk)
        ]
    chunked = torch.cat(outs, 1)
    starts = range(0, ids.shape[1], chunk)
    return [(one[:, s : s + chunk] - chunked[:, s : s + chunk]).abs().max().item() for s in starts]


@pytest.mark.parametrize("cache_kind", ("dynamic", "longlab"))
def test_dynamic_ntk_chunked_prefill_keeps_old_bases_unless_rerotated(cache_kind):
    """The cause of dynamic NTK's jump past L with chunked prefill: cached keys keep the base of their own
    chunk. One attention layer (L = 64, 160 tokens in chunks of 32): without re-rotation the last chunk's
    logits differ from a one-shot forward of all 160 tokens; with re-rotation they are the same (in one
    layer the keys depend on the tokens only, so re-rotated keys are exactly the one-shot keys)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 250, (1, 160))
    diffs = {}
    for rerotate in ("false", "true"):
        model = build_tiny_model("tiny-llama", max_position_embeddings=64, num_hidden_layers=1)
        apply_position(model, f"dynamic-ntk:factor=2,rerotate={rerotate}")
        diffs[rerotate] = _chunked_vs_one_shot(model, ids, 32, cache_kind)
    assert diffs["false"][-1] > 0.1  # the last chunk's queries meet keys of four other bases
    assert diffs["true"][-1] < 1e-4
    # the first two chunks (lengths 32, 64 <= L): plain RoPE in the chunked pass, the 160-token base in
    # the one-shot pass, so both modes differ from one-shot there alike (dynamic NTK by definition)
    assert diffs["true"][:2] == pytest.approx(diffs["false"][:2])


def test_dynamic_ntk_rerotate_gemma3_full_layers_only():
    """Gemma 3: only the full-attention layer is dynamic; re-rotating its cached keys makes the chunked
    last chunk equal the one-shot forward (the sliding layers keep their RoPE, and their keys untouched)."""
    torch.manual_seed(1)
    ids = torch.randint(0, 250, (1, 160))
    model = build_tiny_model("tiny-gemma3", max_position_embeddings=64)
    apply_position(model, "dynamic-ntk:factor=2")
    assert _chunked_vs_one_shot(model, ids, 32, "dynamic")[-1] < 1e-4
    keep = build_tiny_model("tiny-gemma3", max_position_embeddings=64)
    apply_position(keep, "dynamic-ntk:factor=2,rerotate=false")
    assert _chunked_vs_one_shot(keep, ids, 32, "dynamic")[-1] > 1e-2


def test_rotate_keys_composes_rotations():
    """R(m·θ2) k = rotate_keys(R(m·θ1) k, m, θ2 - θ1) in the rotate-half layout; unrotated channels kept."""
    from longlab.position.rope import rotate_keys

    torch.manual_seed(2)
    k = torch.randn(1, 2, 50, 8)
    pos = torch.arange(50).expand(1, 2, 50)
    t1, t2 = torch.tensor([1.0, 0.1]), torch.tensor([0.7, 0.02])  # 2 pairs rotated, channels 4..7 not

    def rope(x, theta):
        return rotate_keys(x, pos, theta)

    assert torch.allclose(rotate_keys(rope(k, t1), pos, t2 - t1), rope(k, t2), atol=1e-5)
    assert torch.equal(rope(k, t1)[..., 4:], k[..., 4:])
    assert torch.allclose(rope(k, t1)[..., :4].norm(dim=-1), k[..., :4].norm(dim=-1), atol=1e-5)


def test_dynamic_ntk_generate_same_tokens_for_any_chunk_size(tokenizer):
    """Through longlab's pipeline (LonglabCache, chunked prefill, decode): with re-rotation a one-layer model
    generates the same tokens whether the 270-token prompt (L = 64) is fed in chunks of 32 or at once."""
    import warnings

    from longlab.generation import generate

    ctx = "the quick brown fox jumps over the lazy dog. " * 6
    texts = []
    for chunk in (32, 4096):
        model = build_tiny_model("tiny-llama", max_position_embeddings=64, num_hidden_layers=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # beyond max_position_embeddings: expected here
            out = generate(
                model, tokenizer, ctx, "what?", recipe="full", max_new_tokens=8, chunk_size=chunk,
                position="dynamic-ntk:factor=2",
            )
        texts.append(out.texts)
    assert texts[0] == texts[1]


def test_rotate_keys_with_a_shared_table_is_the_same_rotation():
    """Layers holding the same positions share one cos/sin table (dynamic NTK's re-rotation per pass)."""
    from longlab.position.rope import rotate_keys, rotation_table

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 50, 16, generator=gen)  # [B, H_kv, T, D], 6 of 8 pairs rotated
    pos = torch.randint(0, 5000, (2, 3, 50), generator=gen)
    delta = torch.rand(6, generator=gen) * 1e-3
    assert torch.equal(rotate_keys(k, pos, delta, rotation_table(pos, delta)), rotate_keys(k, pos, delta))
    assert torch.equal(rotate_keys(k, pos, delta)[..., 12:], k[..., 12:])  # unrotated channels kept
