"""KV reuse (longlab.reuse): assembly identities, reuse methods at ratio 1 = full prefill, the score formulas,
a real partial forward, and bad input. Tiny models, one thread."""

from __future__ import annotations

import math

import pytest
import torch

from longlab import LonglabCache, LonglabError, generate
from longlab.attention import LayerContext
from longlab.reuse import (
    DocStore,
    MemoryStore,
    Runner,
    build_job,
    doc_segment,
    encode_document,
    parse_reuse,
    reuse_prefill,
    split_prompt,
)
from longlab.reuse.policies import APEAttention, CacheBlend, ProphetKV, _AttentionProbe, _with_probe
from longlab.tasks import generate_samples as make_task

TINY = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
DOCS = [" ".join(f"Item {i} is in box {i * 7 % 13}." for i in range(j, j + 6)) for j in (0, 10, 20)]
QUESTION = "Where is item 12?"

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prompt_ids(tokenizer, docs, question):
    prefix, q = split_prompt(tokenizer, question)
    return prefix + [t for d in docs for t in _ids(tokenizer, doc_segment(d))] + q


@torch.inference_mode()
def _full_logits(model, ids):
    return model(input_ids=torch.tensor([ids])).logits[:, -1]


# ------------------------------------------------------------------------------------------ assembly


@pytest.mark.parametrize("name", TINY)
def test_offset0_assembly_equals_prefill(tiny_models, tokenizer, name):
    """One stored document at offset 0 = prefilling it: the same keys/values in every layer, and the same
    logits for a question after it."""
    model = tiny_models[name][0]
    doc_ids = _ids(tokenizer, doc_segment(DOCS[0]))
    doc = encode_document(model, doc_ids)
    runner = Runner(model)
    q_ids = _ids(tokenizer, QUESTION)
    job = build_job(runner, [], [doc_ids], q_ids, [doc])
    ref = LonglabCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([doc_ids]), cache=ref, use_cache=True)
    for got, want in zip(job.cache.layers, ref.layers):
        pos = want.index[0, 0].long()  # sliding layers of the reference may have trimmed old slots
        assert torch.equal(got.index[0, 0, pos].long(), pos)
        torch.testing.assert_close(got.keys[:, :, pos], want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values[:, :, pos], want.values, atol=1e-6, rtol=1e-6)
    pre = reuse_prefill(model, tokenizer, DOCS[:1], QUESTION, "no-recompute")
    full = _full_logits(model, _prompt_ids(tokenizer, DOCS[:1], QUESTION))
    torch.testing.assert_close(pre.logits, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", TINY)
def test_assembly_rope_at_any_offset_and_order(tiny_models, tokenizer, name):
    """Layer 0's pre-RoPE keys depend only on the token, so documents assembled in any order and offset must
    give exactly the keys a full prefill computes at those positions in layer 0 (RoPE fixed per layer
    type)."""
    model = tiny_models[name][0]
    order = [DOCS[2], DOCS[0], DOCS[1]]
    doc_ids = [_ids(tokenizer, doc_segment(d)) for d in order]
    stored = [encode_document(model, ids) for ids in doc_ids]
    q_ids = _ids(tokenizer, QUESTION)
    job = build_job(Runner(model), [], doc_ids, q_ids, stored)
    ref = LonglabCache()
    all_ids = [t for ids in doc_ids for t in ids]
    with torch.inference_mode():
        model(input_ids=torch.tensor([all_ids]), cache=ref, use_cache=True)
    got, want = job.cache.layers[0], ref.layers[0]
    pos = want.index[0, 0].long()
    assert pos.max() > len(doc_ids[0])  # covers documents placed at a non-zero offset
    torch.testing.assert_close(got.keys[:, :, pos], want.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.values[:, :, pos], want.values, atol=1e-6, rtol=1e-6)


def test_rotation_composes(tiny_models):
    """R(p + d) = R(d) R(p) with the model's RoPE (the re-rotation CacheBlend uses)."""
    runner = Runner(tiny_models["tiny-llama"][0])
    k = torch.randn(1, runner.H_kv, 5, runner.head_dim)
    p = torch.arange(3, 8)
    once = runner.rotate(k, p + 40, 0)
    twice = runner.rotate(runner.rotate(k, p, 0), torch.full((5,), 40), 0)
    torch.testing.assert_close(once, twice, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ methods

RATIO_ONE = (
    "cacheblend:recompute=1",
    "cacheblend:recompute=1,gradual=true",
    "prophetkv:recompute=1",
    "prophetkv:recompute=1,dual_stage=true",
    "prophetkv:recompute=1,layers=middle,sink_guard=true",
    "epic:recompute=1",
)


@pytest.mark.parametrize("name", TINY)
def test_ratio_one_is_full_prefill_token_for_token(tiny_models, tokenizer, name):
    model = tiny_models[name][0]
    full = generate(
        model, tokenizer, docs=DOCS, question=QUESTION, reuse="full-prefill", recipe="full", max_new_tokens=8
    )
    direct = _full_logits(model, _prompt_ids(tokenizer, DOCS, QUESTION))
    torch.testing.assert_close(full.reuse.logits, direct, atol=1e-4, rtol=1e-4)
    store = MemoryStore()
    for spec in RATIO_ONE:
        out = generate(
            model, tokenizer, docs=DOCS, question=QUESTION, reuse=spec, store=store, recipe="full",
            max_new_tokens=8,
        )
        assert out.token_ids == full.token_ids, spec
        torch.testing.assert_close(out.reuse.logits, full.reuse.logits, atol=1e-4, rtol=1e-4)
        assert out.reuse.recompute_fraction == pytest.approx(1.0, abs=0.02), spec


@pytest.mark.parametrize("name", TINY)
def test_no_recompute_differs_from_full_on_two_hop(tiny_models, tokenizer, name):
    """Reusing isolated caches loses the cross-document attention a two-hop question needs: the first-token
    logits move (and partial recompute moves them back part of the way on average)."""
    model = tiny_models[name][0]
    sample = make_task("multidoc_qa_2", tokenizer, 1200, 1, 0, num_docs=4)[0]
    docs = sample.metadata["documents"]
    store = MemoryStore()
    ref = reuse_prefill(
        model, tokenizer, docs, sample.question, "full-prefill", answer_prefix=sample.answer_prefix
    )
    naive = reuse_prefill(
        model,
        tokenizer,
        docs,
        sample.question,
        "no-recompute",
        store=store,
        answer_prefix=sample.answer_prefix,
    )
    half = reuse_prefill(
        model,
        tokenizer,
        docs,
        sample.question,
        "cacheblend:recompute=0.5",
        store=store,
        answer_prefix=sample.answer_prefix,
    )
    d_naive = (naive.logits - ref.logits).abs().max().item()
    assert d_naive > 1e-3
    assert (half.logits - ref.logits).abs().max().item() < d_naive


def test_selective_recompute_is_a_partial_forward(tiny_models, tokenizer):
    """Only the selected rows run through the layers after the selection: the last layer's MLP sees
    exactly ceil(ratio * N) document rows plus the question (the cost scales with ratio)."""
    model = tiny_models["tiny-llama"][0]
    seen: list[int] = []
    handle = model.model.layers[-1].mlp.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    try:
        store = MemoryStore()
        n_ctx = sum(len(_ids(tokenizer, doc_segment(d))) for d in DOCS)
        n_q = len(split_prompt(tokenizer, QUESTION)[1])
        for spec, ratio in (
            ("prophetkv:recompute=0.2", 0.2), ("cacheblend:recompute=0.1", 0.1), ("epic:k=4", None)
        ):
            seen.clear()
            pre = reuse_prefill(model, tokenizer, DOCS, QUESTION, spec, store=store)
            want = math.ceil(ratio * n_ctx) if ratio is not None else 4 * len(DOCS)
            assert seen[-1] == want + n_q, spec
            assert pre.cost_fraction < 0.7
    finally:
        handle.remove()


@torch.inference_mode()
def test_cacheblend_selects_top_value_deviation(tiny_models, tokenizer):
    """CacheBlend at check layer 1: layer 0 is recomputed in full, so the fresh V_1 of every token is a full
    prefill's; the recomputed set must be the top ceil(rho N) of ||V_full - V_stored||^2 at layer 1."""
    model = tiny_models["tiny-qwen2"][0]
    doc_ids = [_ids(tokenizer, doc_segment(d)) for d in DOCS]
    stored = [encode_document(model, ids) for ids in doc_ids]
    q_ids = _ids(tokenizer, QUESTION)
    ref = LonglabCache()
    model(input_ids=torch.tensor([[t for d in doc_ids for t in d] + q_ids]), cache=ref, use_cache=True)
    n = sum(map(len, doc_ids))
    v_full = ref.layers[1].values[:, :, :n]
    v_old = torch.cat([d.values[1][None] for d in stored], dim=2)
    dev = (v_full - v_old).pow(2).sum(dim=(0, 1, 3))
    method = CacheBlend(recompute=0.25)
    job = build_job(Runner(model), [], doc_ids, q_ids, stored)
    method.prefill(job)
    layer = job.cache.layers[1]
    order = layer.index[0, 0].long().argsort()
    v_now = layer.values[:, :, order][:, :, :n]
    changed = ((v_now - v_old).abs().amax(dim=(0, 1, 3)) > 0).nonzero()[:, 0]
    want = dev.topk(math.ceil(0.25 * n)).indices.sort().values
    assert torch.equal(changed, want)
    torch.testing.assert_close(v_now[:, :, want], v_full[:, :, want], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_prophetkv_probe_is_mean_question_attention(tiny_models, tokenizer):
    """The probe's layer-0 relevance equals mean_{heads, question tokens} softmax(Q_u K^T s) over the document
    tokens, renormalised (brute force from the question's own queries and the assembled keys)."""
    model = tiny_models["tiny-llama"][0]
    runner = Runner(model)
    doc_ids = [_ids(tokenizer, doc_segment(d)) for d in DOCS]
    stored = [encode_document(model, ids) for ids in doc_ids]
    q_ids = _ids(tokenizer, QUESTION)
    job = build_job(runner, [], doc_ids, q_ids, stored)
    keys0 = job.cache.layers[0].keys.clone()  # [1, H_kv, N, D] stale docs, post-RoPE
    probe = _AttentionProbe(job, len(q_ids))
    _with_probe(job, probe, lambda: job.forward(job.question_rows))
    layer = model.model.layers[0]
    h = layer.input_layernorm(model.model.embed_tokens(torch.tensor([q_ids])))
    attn = layer.self_attn
    q = attn.q_proj(h).view(1, len(q_ids), -1, runner.head_dim).transpose(1, 2)
    k_q = attn.k_proj(h).view(1, len(q_ids), -1, runner.head_dim).transpose(1, 2)
    pos_q = job.pos[job.question_rows]
    q = runner.rotate(q, pos_q, 0)
    k_q = runner.rotate(k_q, pos_q, 0)
    k = torch.cat([keys0, k_q], dim=2).repeat_interleave(q.shape[1] // keys0.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * attn.scaling
    n = keys0.shape[2]
    causal = torch.ones(len(q_ids), n + len(q_ids), dtype=torch.bool)
    causal[:, n:] = torch.ones(len(q_ids), len(q_ids), dtype=torch.bool).tril()
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    r = probs.mean(dim=(0, 1, 2))[:n]
    torch.testing.assert_close(probe.scores[0], r / r.sum(), atol=1e-5, rtol=1e-4)


def test_prophetkv_dual_stage_recomputes_less_at_depth(tiny_models, tokenizer):
    model = tiny_models["tiny-gemma3"][0]  # 4 layers: switch at layer 1
    pre = reuse_prefill(
        model, tokenizer, DOCS, QUESTION, ProphetKV(recompute=0.2, dual_stage=True), store=MemoryStore()
    )
    assert 0.2 < pre.recompute_fraction < 0.4  # 2 rho for layers 0-1, rho after
    assert pre.stages == ["probe", "dual-recompute"]


def test_ape_attention_formula():
    """APE (brute force, as the paper's code computes it): prefix, documents and the rest are three groups;
    the documents' group log-mass is T * logsumexp(s_D / T) + log S, shared by softmax(s_D / T)."""
    torch.manual_seed(0)
    B, H, H_kv, T_q, T, D = 1, 4, 2, 3, 10, 8
    q, k, v = torch.randn(B, H, T_q, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
    key_index = torch.arange(T, dtype=torch.int32)[None, None].expand(B, H_kv, T)
    query_index = torch.tensor([[10, 11, 12]])
    ctx = LayerContext(0, 1, None, "prefill", q, 0.5, query_index, fallback_kv=(k, v, key_index))
    out = APEAttention(lo=2, hi=8, temperature=0.7, scale=1.5).attend(ctx)
    kk = k.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) * 0.5
    docs = (torch.arange(T) >= 2) & (torch.arange(T) < 8)
    vv = v.repeat_interleave(2, 1)
    groups = [torch.arange(T) < 2, docs, torch.arange(T) >= 8]
    mass, parts = [], []
    for gmask, temp, log_s in zip(groups, (1.0, 0.7, 1.0), (0.0, math.log(1.5), 0.0)):
        sg = s[..., gmask] / temp
        mass.append(torch.logsumexp(sg, -1) * temp + log_s)
        parts.append(sg.softmax(-1) @ vv[:, :, gmask])
    w = torch.stack(mass, -1).softmax(-1)  # [B, H, T_q, 3]
    want = sum(w[..., i : i + 1] * parts[i] for i in range(3))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_ape_plain_single_document_is_prefill(tiny_models, tokenizer, name):
    """APE with temperature = scale = 1 and one document is a plain prefill of that document."""
    model = tiny_models[name][0]
    pre = reuse_prefill(model, tokenizer, DOCS[:1], QUESTION, "ape", store=MemoryStore())
    full = _full_logits(model, _prompt_ids(tokenizer, DOCS[:1], QUESTION))
    torch.testing.assert_close(pre.logits, full, atol=1e-4, rtol=1e-4)
    hot = reuse_prefill(model, tokenizer, DOCS[:1], QUESTION, "ape:temperature=0.5", store=MemoryStore())
    assert (hot.logits - full).abs().max() > 1e-3


def test_reuse_with_disk_store_hits_second_time(tiny_models, tokenizer, tmp_path):
    model = tiny_models["tiny-llama"][0]
    store = DocStore(tmp_path / "s")
    a = reuse_prefill(model, tokenizer, DOCS, QUESTION, "prophetkv:recompute=0.2", store=store)
    b = reuse_prefill(model, tokenizer, DOCS, QUESTION, "prophetkv:recompute=0.2", store=store)
    assert store.stats["misses"] == 3 and store.stats["hits"] == 3 and len(store) == 3
    torch.testing.assert_close(a.logits, b.logits)
    from longlab.safeio import new_file_mode  # objects read like the store's other files, not 0o600
    objects = list((tmp_path / "s").rglob("*.safetensors"))
    assert len(objects) == 3 and {o.stat().st_mode & 0o777 for o in objects} == {new_file_mode()}


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "spec",
    ["cacheblend:recompute=1.5", "prophetkv:recompute=-0.1", "epic:recompute=2", "epic:k=-1",
     "ape:temperature=0", "nope", "cacheblend@0.15"],
)
def test_bad_reuse_spec(spec):
    with pytest.raises(LonglabError):
        parse_reuse(spec)


def test_bad_reuse_field_type():
    with pytest.raises(LonglabError, match="recompute"):
        parse_reuse("prophetkv:recompute=abc")
    with pytest.raises(LonglabError, match="no parameter"):
        parse_reuse("cacheblend:budget=3")


def test_bad_docs_and_question(tiny_models, tokenizer):
    model = tiny_models["tiny-llama"][0]
    for docs, question in (
        ([], QUESTION),
        (["  "], QUESTION),
        ("one doc", QUESTION),
        (DOCS, ""),
        (DOCS, None),
    ):
        with pytest.raises(LonglabError):
            reuse_prefill(model, tokenizer, docs, question, "no-recompute")
    with pytest.raises(LonglabError, match="not both"):
        generate(model, tokenizer, "ctx", QUESTION, docs=DOCS)


def test_document_longer_than_positions_writes_nothing(tokenizer, tmp_path):
    from longlab.models import build_tiny_model

    model = build_tiny_model("tiny-llama", max_position_embeddings=64)
    store = DocStore(tmp_path / "s")
    with pytest.raises(LonglabError, match="max_position_embeddings"):
        reuse_prefill(model, tokenizer, ["x" * 100], QUESTION, "no-recompute", store=store)
    with pytest.raises(LonglabError, match="max_position_embeddings"):
        reuse_prefill(model, tokenizer, ["x" * 30, "y" * 30], QUESTION, "no-recompute", store=store)
    assert len(store) == 0
    assert not [p for p in (tmp_path / "s" / "objects").rglob("*") if p.is_file()]


@pytest.mark.parametrize(
    "spec", ["full-prefill", "prophetkv:recompute=0.2", "cacheblend:recompute=0.2", "ape:temperature=0.8"]
)
def test_forced_scoring_agrees_with_greedy_decoding(tiny_models, tokenizer, spec):
    """The eval's "forced" score (a request's ``continuation``) feeds the answer after the prompt; where
    greedy decoding follows the answer, the forced argmax must be exactly the greedy tokens (same cache,
    same positions)."""
    from longlab import Engine, Request

    model = tiny_models["tiny-gemma3"][0]
    sample = make_task("multidoc_qa_1", tokenizer, 1000, 1, 3, num_docs=4)[0]
    docs = sample.metadata["documents"]
    store = MemoryStore()
    (res,) = Engine(model, tokenizer, store=store).run([Request(
        documents=docs, question=sample.question, reuse=spec, answer_prefix=sample.answer_prefix,
        continuation=sample.answers[0],
    )])
    forced, cont = res.forced, res.forced_ids
    assert res.finish_reason == "forced" and len(forced) == len(cont) > 1
    # greedy tokens along the answer: feed the answer itself (teacher forcing) one token at a time
    pre2 = reuse_prefill(
        model, tokenizer, docs, sample.question, spec, store=store, answer_prefix=sample.answer_prefix
    )
    step = [int(pre2.logits[0].argmax())]
    for i, tok in enumerate(cont[:-1]):
        with torch.inference_mode():
            out = model(
                input_ids=torch.tensor([[tok]]),
                position_ids=torch.tensor([[pre2.n_positions + i]]),
                cache=pre2.cache,
                use_cache=True,
            )
        step.append(int(out.logits[0, -1].argmax()))
    assert forced == step
    greedy = generate(
        model,
        tokenizer,
        docs=docs,
        question=sample.question,
        reuse=spec,
        store=store,
        answer_prefix=sample.answer_prefix,
        max_new_tokens=1,
    )
    assert greedy.token_ids[0][0] == forced[0]


def test_gemma_sliding_layers_keep_their_window(tiny_models, tokenizer):
    """Sliding layers hold every document token while the prompt is built (recomputed rows may need any
    of them), then only their window: what a prefill's sliding layer can still show."""
    model = tiny_models["tiny-gemma3"][0]
    pre = reuse_prefill(model, tokenizer, DOCS, QUESTION, "prophetkv:recompute=0.2", store=MemoryStore())
    window = model.config.sliding_window
    for layer, kind in zip(pre.cache.layers, model.config.layer_types):
        held = int(layer.valid.sum(-1).max())
        if kind == "sliding_attention":
            assert held <= window
            assert int(layer.index.min()) == pre.n_positions - window  # the newest `window` positions
        else:
            assert held == pre.n_positions


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b"])
def test_real_model_identities(name):
    """On a real model: one stored document at offset 0 = prefill (logits), ratio 1 = full prefill token
    for token, and no-recompute differs."""
    from longlab import load_model

    try:
        model, tok = load_model(name)
    except LonglabError as exc:  # weights package not installed
        pytest.skip(str(exc))
    sample = make_task("multidoc_qa_1", tok, 4 * 150 + 200, 1, 0, num_docs=4, doc_tokens=150)[0]
    docs, q, prefix = sample.metadata["documents"], sample.question, sample.answer_prefix
    store = MemoryStore()
    plain = dict(answer_prefix=prefix, chat_template=False)  # no chat prefix: the document sits at offset 0
    one = reuse_prefill(model, tok, docs[:1], q, "no-recompute", store=store, **plain)
    ref1 = reuse_prefill(model, tok, docs[:1], q, "full-prefill", **plain)
    torch.testing.assert_close(one.logits, ref1.logits, atol=2e-3, rtol=1e-3)
    # with the chat prefix, APE encodes the document after it: one document is again a plain prefill
    ape = reuse_prefill(model, tok, docs[:1], q, "ape", store=store, answer_prefix=prefix)
    ref2 = reuse_prefill(model, tok, docs[:1], q, "full-prefill", answer_prefix=prefix)
    torch.testing.assert_close(ape.logits, ref2.logits, atol=2e-3, rtol=1e-3)
    kw = dict(docs=docs, question=q, answer_prefix=prefix, store=store, max_new_tokens=10, recipe="full")
    full = generate(model, tok, reuse="full-prefill", **kw)
    for spec in ("cacheblend:recompute=1", "prophetkv:recompute=1", "epic:recompute=1"):
        assert generate(model, tok, reuse=spec, **kw).token_ids == full.token_ids, spec
    naive = reuse_prefill(model, tok, docs, q, "no-recompute", store=store, answer_prefix=prefix)
    assert (naive.logits - full.reuse.logits).abs().max() > 1e-2
