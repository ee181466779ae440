"""Method state lives on the cache layer (``layer.state`` / ``layer.extras``): forks copy it, batch
selection and the quantization swap carry it, ``nbytes`` counts it, and RetroAttention's pre-hooks go
away with their cache. No method module keeps per-layer state of its own."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import weakref

import pytest
import torch

from longlab.attention import LayerContext
from longlab.cache import LonglabCache, LonglabLayer
from longlab.engine.stream import Stream
from longlab.kv.indexmem import IndexMem, init_layer
from longlab.models import build_tiny_model
from longlab.recipe import Recipe, parse_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread

PROMPT = [30 + (i * 7) % 200 for i in range(150)]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-llama", num_hidden_layers=4)  # layers 2, 3 are sparse for Quest/Retro


@dataclasses.dataclass
class _RandomIndexMem(IndexMem):
    """IndexMem with seeded, untrained weights per layer (``init_layer``), so it runs without a file."""

    def _layer_weights(self, ctx):
        H, D = ctx.q.shape[1], ctx.q.shape[-1]
        gen = torch.Generator().manual_seed(100 + ctx.layer_idx)
        return init_layer(H, ctx.key_index.shape[1], D, ctx.scaling, gen)


def _recipe(spec):
    if spec == "indexmem-random":
        return Recipe(kv=[_RandomIndexMem(budget=48, window_size=8, decode_evict=True)])
    return parse_recipe(spec)


def _steps(stream, logits, n):
    """Greedy decoding: ``n`` tokens and the logits each was chosen from."""
    tokens, seen = [], []
    for _ in range(n):
        seen.append(logits)
        token = int(logits[0].argmax())
        tokens.append(token)
        logits = stream.feed([[token]], compress="none")
    return tokens, seen, logits


def _run(model, spec, before, after, fork=False):
    stream = Stream(model, LonglabCache(_recipe(spec)), 1)
    logits = stream.feed([PROMPT], chunk_size=64)
    tokens, seen, logits = _steps(stream, logits, before)
    if not fork:
        rest, seen_rest, _ = _steps(stream, logits, after)
        return tokens + rest, seen + seen_rest, stream
    twin = stream.fork()
    out = []
    for s in (stream, twin):  # the parent first, then the fork: neither may disturb the other
        rest, seen_rest, _ = _steps(s, logits, after)
        out.append((tokens + rest, seen + seen_rest, s))
    return out


STATEFUL = [
    ("quest:budget=32,page_size=8", "quest.center"),
    ("retro:budget=32,page_size=8,window=4", "retro.o"),
    ("decoding:base=snapkv,interval=6,budget=120,window_size=8", "decoding.queries"),
    ("indexmem-random", "indexmem_M"),
    ("decoding:base=snapkv,interval=6,budget=120,window_size=8+kivi2:residual=32", "decoding.queries"),
    ("quest:budget=32,page_size=8+kivi2:residual=32", "quest.center"),
]


@pytest.mark.parametrize("spec, key", STATEFUL, ids=[s for s, _ in STATEFUL])
def test_forking_mid_decode_gives_the_tokens_of_independent_runs(model, spec, key):
    first = _run(model, spec, 14, 10)
    second = _run(model, spec, 14, 10)
    assert first[0] == second[0]
    for tokens, logits, stream in _run(model, spec, 6, 18, fork=True):
        assert tokens == first[0]
        for got, want in zip(logits, first[1]):
            assert torch.equal(got, want)  # bit for bit: nothing was lost or shared at the fork
        layer = stream.cache.layers[-1]
        assert key in layer.state  # the method's per-layer state is on the layer ...
        counted = sum(t.numel() * t.element_size() for t in layer.state.values())
        assert counted > 0 and layer.nbytes() >= counted  # ... and counted in its bytes
    if spec.startswith("decoding"):  # decode-time eviction really ran after the fork
        assert all(int(x.max()) <= 126 for x in first[2].cache.lengths())


def test_fork_copies_state_instead_of_sharing_it(model):
    stream = Stream(model, LonglabCache("decoding:base=snapkv,interval=6,budget=120,window_size=8"), 1)
    _steps(stream, stream.feed([PROMPT], chunk_size=64), 3)  # the buffer holds decode queries only
    assert stream.cache.layers[0].state["decoding.queries"].shape[2] == 3
    twin = stream.fork()
    a, b = stream.cache.layers[0].state, twin.cache.layers[0].state
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]) and a[name].data_ptr() != b[name].data_ptr()


def test_batch_selection_keeps_decode_state_per_row(model):
    spec = "decoding:base=snapkv,interval=6,budget=120,window_size=8"
    other = [40 + (i * 11) % 190 for i in range(150)]
    single = Stream(model, LonglabCache(spec), 1)
    logits = single.feed([other], chunk_size=64)
    want, _, _ = _steps(single, logits, 16)

    batch = Stream(model, LonglabCache(spec), 2)
    logits = batch.feed([PROMPT, other], chunk_size=64)
    got = []
    for step in range(16):
        token = logits.argmax(-1)
        got.append(int(token[-1]))  # row 1 (the only row once row 0 is dropped)
        if step == 5:  # drop row 0 mid-decode, as a batched decode drops a finished row
            batch.cache.batch_select_indices(torch.tensor([1]))
            batch.seen_mask, batch.next_pos = batch.seen_mask[1:], batch.next_pos[1:]
            token = token[1:]
        logits = batch.feed([[int(t)] for t in token], compress="none")
    assert got == want
    assert batch.cache.layers[0].state["decoding.queries"].shape[0] == 1


def test_quantization_swap_carries_state_and_extras():
    from longlab.quant.storage import QuantizedLayer

    k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    cache = LonglabCache("h2o@0.5+kivi2")
    layer = LonglabLayer()
    layer.update(k, v)
    cache.layers.append(layer)
    layer.state["probe"] = torch.arange(6.0).reshape(1, 6)
    layer.extras["probe_slot"] = torch.ones(1, 2, 300)
    q = torch.randn(1, 4, 8, 16)
    ctx = LayerContext(0, 1, None, "prefill", q, 0.25, layer.index[:, 0, -8:], None, layer, cache)
    assert cache.recipe.kv[-1].apply(ctx)
    new = cache.layers[0]
    assert isinstance(new, QuantizedLayer) and new is not layer
    assert torch.equal(new.state["probe"], layer.state["probe"]) and "probe_slot" in new.extras
    assert new.state is not layer.state  # its own dicts, not aliases of the old layer's
    assert any(t is new.state["probe"] for t in new.tensors())  # counted in nbytes


def _hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_retro_hooks_are_removed_with_their_cache(model):
    assert _hook_count(model) == 0

    def decode(cache, n=4):
        stream = Stream(model, cache, 1)
        logits = stream.feed([PROMPT], chunk_size=64)
        _steps(stream, logits, n)
        return stream

    with LonglabCache("retro:budget=32,page_size=8,window=4") as cache:  # context manager: closed on exit
        decode(cache)
        assert _hook_count(model) == 4  # one per decoder layer
    assert _hook_count(model) == 0

    cache = LonglabCache("retro:budget=32,page_size=8,window=4")
    stream = decode(cache)
    twin = stream.fork()
    cache.close()  # the fork still decodes with the shared hooks
    assert _hook_count(model) > 0
    _steps(twin, twin.feed([[5]], compress="none"), 2)
    del twin
    gc.collect()  # garbage collection releases the fork's share: nothing is left on the model
    assert _hook_count(model) == 0

    cache = LonglabCache("retro:budget=32,page_size=8,window=4")
    decode(cache)
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None and _hook_count(model) == 0


@pytest.mark.parametrize(
    "module", ["longlab.decode.quest", "longlab.decode.retro", "longlab.kv.decoding", "longlab.kv.indexmem"]
)
def test_no_module_level_per_layer_state(module):
    mod = importlib.import_module(module)
    weak = (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)
    offenders = [name for name, value in vars(mod).items() if isinstance(value, weak)]
    assert offenders == []
