"""C-DIC (spec §25): bounded memory, write-back locality, retrieval order, ra-TBPTT detachment, the
dialogue_threads generator's truth, and the baselines' selection rules."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from longlab.errors import LonglabError
from longlab.memory.cdic import CdicConfig, CdicMemory, CdicModel, TokenReader, add_only_answer, train_system
from longlab.tasks.dialogue_threads import VOCAB, L, Turn, conversation, probe, replay

SMALL = CdicConfig(dim=16, n_layers=1, n_heads=2, m=2, n_max=3, r=2)


def _model(cfg: CdicConfig = SMALL) -> CdicModel:
    torch.manual_seed(0)
    return CdicModel(cfg).eval()


def _turn(rng: random.Random) -> torch.Tensor:
    return torch.tensor([[rng.randrange(VOCAB.size) for _ in range(L)]])


@pytest.mark.parametrize("theta", [0.5, 1.01])  # 1.01: every turn opens a thread, so slots are evicted (LRU)
def test_memory_bytes_bounded_whatever_the_turn_count(theta):
    cfg = CdicConfig(**{**SMALL.__dict__, "theta_new": theta})
    mem = CdicMemory(_model(cfg), 1)
    rng = random.Random(0)
    bound = cfg.n_max * cfg.m * cfg.dim * 4
    with torch.no_grad():
        for _t in range(60):
            mem.step(_turn(rng))
            assert mem.state_bytes() <= bound
            assert mem.total_bytes() <= cfg.n_max * (cfg.m + 1) * cfg.dim * 4
    assert mem.states.shape == (1, cfg.n_max, cfg.m, cfg.dim)
    assert int(mem.used.sum()) <= cfg.n_max


def test_unretrieved_slots_bit_identical_after_write_back():
    mem = CdicMemory(_model(), 2)
    rng = random.Random(1)
    with torch.no_grad():
        for _ in range(8):  # fill every slot
            mem.step(torch.cat([_turn(rng), _turn(rng)]), thread=torch.tensor([_ % 3, (_ + 1) % 3]))
        before = mem.states.clone()
        keys = mem.keys.clone()
        _, info = mem.step(torch.cat([_turn(rng), _turn(rng)]))
    for b in range(2):
        touched = set(info["idx"][b].tolist())
        for j in range(SMALL.n_max):
            if j not in touched:
                assert torch.equal(mem.states[b, j], before[b, j])  # bit-identical
                assert torch.equal(mem.keys[b, j], keys[b, j])
        assert not torch.equal(mem.states[b, info["idx"][b, 0]], before[b, info["idx"][b, 0]])


def test_retrieval_takes_the_most_similar_slots_not_the_least():
    """Hand-set keys: the turn's key is closest to slot 2, then slot 0, farthest from slot 1. The
    first retrieved
    slot must be 2 and the second 0 (an inverted rule would pick 1)."""
    model = _model()
    mem = CdicMemory(model, 1)
    e = F.normalize(torch.tensor([[1.0, 0.2] + [0.0] * 14]), dim=-1)
    mem.keys[0, 2] = F.normalize(torch.tensor([1.0, 0.1] + [0.0] * 14), dim=-1)  # cos ≈ 0.99
    mem.keys[0, 0] = F.normalize(torch.tensor([1.0, -1.0] + [0.0] * 14), dim=-1)  # cos ≈ 0.55
    mem.keys[0, 1] = F.normalize(torch.tensor([-1.0, 0.0] + [0.0] * 14), dim=-1)  # cos ≈ -0.98
    mem.used[:] = True
    idx, cos, new, valid = mem.route(e, None)
    assert idx.tolist() == [[2, 0]]
    assert not bool(new[0]) and valid.all()
    assert cos[0, 0] > cos[0, 1]
    # below θ_new a new thread opens in the least recently used slot
    mem.last[0] = torch.tensor([5, 1, 7])
    idx, _, new, _ = mem.route(-F.normalize(torch.ones(1, 16), dim=-1) * 0 + torch.eye(16)[5:6], None)
    assert bool(new[0]) and idx[0, 0].item() == 1


def test_states_older_than_K_turns_get_no_gradient():
    model = CdicModel(SMALL)
    mem = CdicMemory(model, 1)
    rng = random.Random(2)
    mem.states = mem.states.clone().requires_grad_(True)
    leaf = mem.states
    mem.step(_turn(rng), thread=torch.tensor([0]))
    mem.detach()  # the ra-TBPTT window boundary
    logits, _ = mem.step(_turn(rng), thread=torch.tensor([0]))
    logits.sum().backward()
    assert leaf.grad is None
    assert model.memq.grad is not None  # the window itself does train


def test_generator_truth_is_consistent():
    rng = random.Random(3)
    for _ in range(20):
        turns = conversation(rng, 80, rng.randint(2, 10))
        qs = [t for t in turns if t.kind == "question"]
        assert [t.answer for t in qs] == replay(turns)
        for i, t in enumerate(turns):  # distance: turns since the slot was last set
            if t.kind == "question":
                topic = t.tokens[1]
                last = max(
                    j
                    for j in range(i)
                    if turns[j].tokens[0] == topic
                    and (turns[j].kind == "open" or (turns[j].kind == "revise" and turns[j].slot == t.slot))
                )
                assert t.distance == i - last
    for d in (5, 20, 50):
        for r in (0, 1, 3):
            turns = probe(random.Random(d * 10 + r), d, r)
            assert turns[-1].distance == d and turns[-1].revisions == r
            assert replay(turns)[-1] == turns[-1].answer
            assert len(turns) == len(probe(random.Random(99), d, r))  # equal lengths within a cell
    with pytest.raises(LonglabError, match="distance"):
        probe(rng, 0, 1)


def test_add_only_keeps_the_superseded_fact_and_last_k_truncates():
    v = VOCAB
    t0, s1 = v.topic0 + 3, v.slot0 + 1
    turns = [
        Turn([t0, v.value0 + 1, v.value0 + 2, v.value0 + 3], "open", 0),
        Turn([t0, s1, v.value0 + 9, v.filler0], "revise", 0, slot=1),
        Turn([v.Q, t0, s1, v.Q], "question", 0, slot=1, answer=v.value0 + 9),
    ]
    assert replay(turns) == [v.value0 + 9]
    assert add_only_answer(turns, 128) == v.value0 + 2  # no supersession: ties go to the earliest fact
    assert add_only_answer(turns, 1) == v.value0 + 9  # FIFO evicted the old fact
    reader = TokenReader(None, 1)  # type: ignore[arg-type]
    assert reader.tokens(turns) == turns[1].tokens + turns[2].tokens
    assert TokenReader(None, None).tokens(turns) == [x for t in turns for x in t.tokens]  # type: ignore[arg-type]


def test_train_and_bad_arguments(tmp_path):
    info = train_system("cdic", str(tmp_path / "c"), max_steps=1, minutes=1, cfg=SMALL, batch=2, n_turns=4)
    assert info["steps"] == 1 and (tmp_path / "c" / "model.safetensors").is_file()
    with pytest.raises(LonglabError, match="--system"):
        train_system("nope", str(tmp_path / "x"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "user.txt").write_text("x")
    with pytest.raises(LonglabError, match="--out"):
        train_system("cdic", str(tmp_path / "mine"), max_steps=1, cfg=SMALL)


def test_report_from_stored_rows_and_cli(tmp_path, capsys):
    from longlab.cli import main
    from longlab.eval.store import ResultStore
    from longlab.memory.cdic import DISTANCES, SYSTEMS, cdic_report

    with ResultStore(tmp_path / "s") as store:
        for sysname in SYSTEMS:
            for d in DISTANCES:
                for i in range(4):
                    score = float(sysname == "cdic" or (sysname == "lastk" and d <= 20))
                    store.add(
                        {
                            "model": "lab",
                            "recipe": sysname,
                            "method": "cdic",
                            "task": "dialogue_threads",
                            "length": d,
                            "depth": float(i % 4),
                            "seed": 0,
                            "sample_id": f"p-{d}-{i}",
                            "score": score,
                            "routing": 1.0,
                        }
                    )
    text = cdic_report(str(tmp_path / "s"))
    assert "| cdic | 100.0 [" in text
    assert "| cdic − lastk | d = 200 | +100.0 [+100.0, +100.0] (significant" in text
    assert "| cdic − lastk | d = 5 | +0.0 [+0.0, +0.0] (not significant" in text
    assert main(["memory", "cdic", "report", str(tmp_path / "s")]) == 0
    assert (
        main(["memory", "cdic", "train", "--system", "cdic", "--out", str(tmp_path / "x"), "--minutes", "-1"])
        == 2
    )
    assert "--minutes" in capsys.readouterr().err


@pytest.mark.slow  # ~12 s on one loaded core
def test_train_eval_report_end_to_end_api_and_cli(tmp_path, capsys):
    """C-DIC's whole path on a small lab config: train both checkpoints (API), evaluate every system on the
    same probes (CLI) into a store, then the report (API and CLI) reads them. (C-DIC is a purpose-trained
    lab model, not a chat model: there is no endpoint variant.)"""
    from longlab.cli import main
    from longlab.eval.store import ResultStore
    from longlab.memory.cdic import DISTANCES, REVISIONS, SYSTEMS, cdic_report

    for system in ("cdic", "tokens"):
        train_system(system, str(tmp_path / system), max_steps=1, minutes=1, cfg=SMALL, batch=2, n_turns=4)
    store = str(tmp_path / "store")
    args = ["memory", "cdic", "eval", "--cdic", str(tmp_path / "cdic"), "--tokens", str(tmp_path / "tokens")]
    assert main([*args, "--out", store, "--per-cell", "1"]) == 0
    with ResultStore(store, readonly=True) as st:
        acc = [r for r in st.rows(method="cdic") if r["task"] == "dialogue_threads"]
    assert len(acc) == len(SYSTEMS) * len(DISTANCES) * len(REVISIONS)
    assert {r["recipe"] for r in acc} == set(SYSTEMS) and all(r["score"] in (0.0, 1.0) for r in acc)
    assert "| cdic |" in cdic_report(store)
    capsys.readouterr()
    assert main(["memory", "cdic", "report", store]) == 0 and "| addonly |" in capsys.readouterr().out
