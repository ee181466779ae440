"""Long-context layers from other modalities in the layers lab (issue 33): EMFormer's merged multi-scale conv,
rollout training and composite loss; MEG-XL's criss-cross block and block mask; TAPTRv3's VLTA; the TS
spiking neuron. Each test fails when its mechanism's rule is broken or inverted."""

from __future__ import annotations

import math

import pytest
import torch

from longlab.lab import LabConfig, LabLM, Positions, mixer_config
from longlab.lab.mixers.emformer import MultiScaleConv
from longlab.lab.mixers.spiking import SpikingLayer, spike
from longlab.lab.tasks import task_config
from longlab.lab.tasks.lorenz96 import composite_loss, lorenz96_rk4
from longlab.lab.train import TrainConfig, load_checkpoint, train
from longlab.recipe import LonglabError

D, H = 16, 4


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mixer(spec: str, positions: str = "rope", seed: int = 0):
    torch.manual_seed(seed)
    return mixer_config(spec).build(D, H, Positions(positions, H, D // H)).double().eval()


# -- EMFormer -------------------------------------------------------------------------------------------


def test_merged_conv_equals_the_three_conv_sum_forward_and_backward():
    torch.manual_seed(0)
    conv = MultiScaleConv(6).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 11, 6, dtype=torch.float64)
    merged = conv(x)
    sep = conv.forward_separate(x)
    torch.testing.assert_close(merged, sep)
    grads_m = torch.autograd.grad((merged * g).sum(), [x, *conv.weights])
    grads_s = torch.autograd.grad((sep * g).sum(), [x, *conv.weights])
    for a, b in zip(grads_m, grads_s):
        torch.testing.assert_close(a, b)
    # by hand: y[t] = Σ_k Σ_{i<k} w_k[:, i] x[t − i]
    w1, w3, w5 = (w.detach() for w in conv.weights)
    xd = x.detach()
    t = 7
    ref = w1[:, 0] * xd[:, t] + sum(w3[:, i] * xd[:, t - i] for i in range(3)) + sum(
        w5[:, i] * xd[:, t - i] for i in range(5))
    torch.testing.assert_close(merged[:, t].detach(), ref)


def test_merged_conv_never_reads_ahead_and_its_impulse_response_is_the_lagged_kernel():
    torch.manual_seed(1)
    conv = MultiScaleConv(3).double()
    x = torch.zeros(1, 9, 3, dtype=torch.float64)
    x[0, 2] = 1.0  # an impulse at t = 2
    with torch.no_grad():
        y = conv(x)[0]  # [T, C]
        w = conv.merged_kernel()  # [C, 5], tap i = lag i
    assert (y[:2] == 0).all()  # nothing before the impulse: no reading ahead
    torch.testing.assert_close(y[2:7].T, w)  # y[2 + i] = w[:, i] (a flipped kernel fails)
    assert (y[7:] == 0).all()
    # and the whole EMFormer mixer is causal
    mod = _mixer("emformer:row_chunk=4")
    a = torch.randn(2, 12, D, dtype=torch.float64)
    b = a.clone()
    b[:, 8:] += torch.randn(2, 4, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mod(a)[:, :8], mod(b)[:, :8], rtol=0, atol=0)
        merged_out = mod(a)
        mod.merged = False
        torch.testing.assert_close(mod(a), merged_out)  # separate convs: the same layer


def test_composite_loss_theta_minus_half_pi_is_pure_l2():
    pred, target = torch.randn(5, 7, 40), torch.randn(5, 7, 40)
    l2 = ((pred - target) ** 2).mean()
    rmse = torch.sqrt(((pred - target) ** 2).mean(-1)).mean()
    torch.testing.assert_close(composite_loss(pred, target, torch.tensor(-math.pi / 2)), l2)
    torch.testing.assert_close(composite_loss(pred, target, torch.tensor(math.pi / 2)), rmse)
    half = composite_loss(pred, target, torch.tensor(0.0))  # w = 1/2
    torch.testing.assert_close(half, 0.5 * (l2 + rmse))
    assert task_config("lorenz96").loss_params == (-math.pi / 2,)


def test_lorenz96_integrator_and_normalised_trajectories():
    # RK4 of dx/dt at the fixed point x_i = F stays there; a perturbation grows (chaos at F = 8)
    x = torch.full((40,), 8.0, dtype=torch.float64)
    torch.testing.assert_close(lorenz96_rk4(x, 8.0, 0.05), x)
    task = task_config("lorenz96")
    b = task.sample(16, 20, _gen(3))
    assert b.tokens.shape == (16, 20, 40) and b.answer[:, 8:].all() and not b.answer[:, :8].any()
    assert abs(float(b.tokens.mean())) < 0.3 and 0.7 < float(b.tokens.std()) < 1.3  # normalised
    raw = task.trajectories(2, 3, _gen(4))
    torch.testing.assert_close(raw[:, 1], lorenz96_rk4(raw[:, 0], 8.0, 0.05))  # consecutive states
    again = task.sample(16, 20, _gen(3))
    assert torch.equal(b.tokens, again.tokens)  # seeded


class _Recorder(torch.nn.Module):
    """A forecaster that records its inputs: out = x @ A (so out[:, -1] depends on the last state)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(0.9 * torch.eye(n))
        self.loss_params = torch.nn.Parameter(torch.tensor([-math.pi / 2]))
        self.inputs: list[torch.Tensor] = []

    def forward(self, x):
        self.inputs.append(x)
        return x @ self.a


def test_rollout_training_feeds_detached_predictions_one_update_per_step():
    task = task_config("lorenz96:n=6,window=3")
    b = task.sample(2, 3 + 4, _gen(0))
    model = _Recorder(6)
    losses = list(task.train_losses(model, b, rollout=4))
    assert len(losses) == 4  # one loss (and one optimizer update) per rollout step
    first, second = model.inputs[0], model.inputs[1]
    torch.testing.assert_close(first, b.tokens[:, :3])
    pred1 = (first @ model.a)[:, -1]
    torch.testing.assert_close(second[:, :2], b.tokens[:, 1:3])
    torch.testing.assert_close(second[:, 2], pred1)  # the prediction is the newest input ...
    assert not second.requires_grad  # ... detached: no gradient through the earlier step
    torch.testing.assert_close(losses[1], ((second @ model.a)[:, -1] - b.tokens[:, 4]).pow(2).mean())
    with pytest.raises(LonglabError, match="rollout"):
        next(task.train_losses(model, task.sample(1, 5, _gen(0)), rollout=4))  # 3 + 4 > 5 states
    one = list(task.train_losses(model, b))
    assert len(one) == 1  # one-step: the window's outputs against the next states


def test_lorenz96_trains_from_the_cli_config_and_rollout_finetunes_from_init(tmp_path):
    base = dict(mixer="emformer", task="lorenz96:n=8,spinup=5,pool=8", dim=16, n_layers=1, n_heads=2,
                batch=4, ckpt_every=5)
    train(TrainConfig(train_len=9, steps=3, **base), tmp_path / "pre", progress=False, log=None)
    pre, _, _ = load_checkpoint(tmp_path / "pre")
    m = train(TrainConfig(train_len=13, steps=2, rollout=5, init=str(tmp_path / "pre"), **base),
              tmp_path / "ft", progress=False, log=None)
    ft, cfg, _ = load_checkpoint(tmp_path / "ft")
    assert m["step"] == 2 and cfg.rollout == 5 and "loss_params" in dict(ft.named_parameters())
    moved = [not torch.equal(a, b) for a, b in zip(pre.state_dict().values(), ft.state_dict().values())]
    assert any(moved)
    with pytest.raises(LonglabError, match="rollout"):
        TrainConfig(train_len=9, steps=2, rollout=5, **base)  # the window of 8 + 5 steps need 13 states
    with pytest.raises(LonglabError, match="rollout"):
        TrainConfig(mixer="softmax", task="copy", train_len=16, steps=2, rollout=2)
    with pytest.raises(LonglabError, match="--init"):
        train(TrainConfig(train_len=9, steps=1, init=str(tmp_path / "nothing"), **base), tmp_path / "x",
              progress=False, log=None)
    assert not (tmp_path / "x").exists()  # a bad --init leaves nothing behind


def test_lorenz96_predict_is_the_autoregressive_rollout():
    task = task_config("lorenz96:n=6,window=3")
    b = task.sample(2, 8, _gen(1))
    model = _Recorder(6)
    with torch.no_grad():
        out = task.predict(model, b.tokens)
    x = b.tokens[:, 2]
    for k in range(5):  # with out = x @ A the rollout is x_{t+1} = x_t A
        x = x @ model.a
        torch.testing.assert_close(out[:, 3 + k], x)
    assert set(task.metrics(out[:1], b)) == {"rmse@1", "rmse@5"}


# -- MEG-XL -----------------------------------------------------------------------------------------------


def _attend(x, qkv, o, heads, rotate=None):
    """Brute-force bidirectional attention over the middle axis of ``x: [N, S, d]``."""
    n, s, d = x.shape
    hd = d // heads
    q, k, v = (qkv(x).view(n, s, 3, heads, hd)[:, :, i].transpose(1, 2) for i in range(3))
    if rotate is not None:
        q, k = rotate(q), rotate(k)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1)
    return o((w @ v).transpose(1, 2).reshape(n, s, d))


@pytest.mark.parametrize("positions", ["rope", "nope"])
def test_criss_cross_block_is_time_and_channel_attention_on_the_halves(positions):
    mod = _mixer("crisscross:channels=3", positions)
    t, c = 5, 3
    x = torch.randn(2, t * c, D, dtype=torch.float64)
    with torch.no_grad():
        y = mod(x).view(2, t, c, D)
        g = x.view(2, t, c, D)
        half = D // 2
        pos = Positions(positions, H, D // H)
        for ch in range(c):  # time attention within each channel, on the first half, RoPE over time
            ref = _attend(g[:, :, ch, :half], mod.time.qkv, mod.time.o, H // 2,
                          lambda z: pos.rotate(z, torch.arange(t)))
            torch.testing.assert_close(y[:, :, ch, :half], ref)
        for step in range(t):  # channel attention within each time step, on the second half
            ref = _attend(g[:, step, :, half:], mod.chan.qkv, mod.chan.o, H // 2)
            torch.testing.assert_close(y[:, step, :, half:], ref)


def test_rope_acts_on_the_time_half_only():
    rope = _mixer("crisscross:channels=4", "rope")
    nope = _mixer("crisscross:channels=4", "nope")
    nope.load_state_dict(rope.state_dict())
    x = torch.randn(2, 6 * 4, D, dtype=torch.float64)
    with torch.no_grad():
        a, b = rope(x).view(2, 6, 4, D), nope(x).view(2, 6, 4, D)
    torch.testing.assert_close(a[..., D // 2 :], b[..., D // 2 :], rtol=0, atol=0)  # channel half: no RoPE
    assert (a[..., : D // 2] - b[..., : D // 2]).abs().max() > 1e-3  # time half: rotated
    # the time half is equivariant to a shift of the channels' order (no position over channels) ...
    perm = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        ap = rope(x.view(2, 6, 4, D)[:, :, perm].reshape(2, 24, D)).view(2, 6, 4, D)
    torch.testing.assert_close(ap, a[:, :, perm])


def test_block_mask_covers_exactly_20_of_50_subsegments_across_all_channels():
    task = task_config("meg")  # 16 channels, subsegments of 10 steps, 40 % masked
    b = task.sample(3, 500 * 16, _gen(2))
    m = b.answer.view(3, 500, 16)
    assert (m == m[..., :1]).all()  # every channel masked together
    steps = m[..., 0].view(3, 50, 10)
    assert ((steps.all(-1)) | (~steps.any(-1))).all()  # whole subsegments only
    assert (steps.all(-1).sum(-1) == 20).all()  # exactly 20 of the 50
    per = task.per_channel  # 8 background + 8 event codes
    mask_ids = 16 * per + torch.arange(16)
    tok = b.tokens.view(3, 500, 16)
    assert (tok[m] == mask_ids.expand(3, 500, 16)[m]).all()  # masked inputs are the channel's mask token
    assert (b.targets[b.answer] < 16 * per).all() and (b.targets[~b.answer] == -100).all()
    assert (tok[~m] < 16 * per).all() and (tok[~m] // per == torch.arange(16).expand(3, 500, 16)[~m]).all()
    with pytest.raises(LonglabError, match="multiple"):
        task.sample(1, 16 * 15, _gen(0))


def test_meg_events_need_the_state_and_the_echo_names_the_word():
    task = task_config("meg")
    codes, state, words, echo = task.signal(6, 400, _gen(5), centre=True)
    ev = words >= 0
    assert ev.any() and echo.any() and (echo <= ev).all()
    w, s = words[ev & ~echo], state[ev & ~echo]
    torch.testing.assert_close(codes[ev & ~echo], task.response[(w + s) % task.words])  # A[(w + s) mod W]
    torch.testing.assert_close(codes[echo], task.echo[words[echo]])  # B[w]
    assert (codes[ev] >= task.codes).all() and (codes[~ev] < task.codes).all()  # event codes are their own
    c0 = task.centre_start(400)
    assert (words[:, c0] >= 0).all() and (echo[:, c0 + 4 : c0 + 8]).all()
    switches = (state[:, 1:] != state[:, :-1]).float().mean()
    assert 0.001 < float(switches) < 0.02  # mean dwell 200 steps


def test_linear_probe_recovers_a_linear_rule():
    from longlab.lab.tasks.meg import fit_linear_probe

    g = _gen(0)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    mean, std, w, b = fit_linear_probe(x[:100], y[:100], 4, l2=1e-4)
    acc = ((((x[100:].double() - mean) / std) @ w + b).argmax(-1) == y[100:]).float().mean()
    assert acc >= 0.85  # chance: 0.25


# -- TAPTRv3 VLTA ------------------------------------------------------------------------------------------


def test_vlta_with_full_visibility_is_causal_attention():
    vlta = _mixer("vlta:row_chunk=5")
    soft = _mixer("softmax:row_chunk=5")
    soft.load_state_dict(vlta.state_dict(), strict=False)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    vlta.visibility = lambda z: torch.ones(z.shape[:2], dtype=z.dtype)
    with torch.no_grad():
        torch.testing.assert_close(vlta(x), soft(x))
        vlta.visibility = lambda z: torch.full(z.shape[:2], 0.3, dtype=z.dtype)
        torch.testing.assert_close(vlta(x), soft(x))  # a constant visibility cancels in the softmax


def test_vlta_weights_are_visibility_times_exp_scores_renormalised():
    vlta = _mixer("vlta")
    scores = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    valid = torch.ones(4, 4, dtype=torch.bool).tril()
    scores = scores.masked_fill(~valid, -1e30)
    v = torch.tensor([[0.9, 0.0, 0.5, 1.0]], dtype=torch.float64)
    vlta._logv = torch.log(v + vlta.eps)
    w = vlta.weights(scores, valid, torch.arange(4), None)
    ref = (v[:, None, None, :] + vlta.eps) * torch.exp(scores) * valid
    ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(w, ref)
    assert (w[..., 1:, 1] < 1e-5).all()  # an invisible frame gets weight ~0 (an inverted log v fails)
    # in the mixer: an invisible key's value does not reach the later queries
    x = torch.randn(1, 8, D, dtype=torch.float64)
    y = x.clone()
    y[:, 3] += 5.0
    vis = torch.ones(1, 8, dtype=torch.float64)
    vis[:, 3] = 0.0
    vlta.visibility = lambda z: vis.expand(z.shape[0], -1)
    with torch.no_grad():
        torch.testing.assert_close(vlta(x)[:, 4:], vlta(y)[:, 4:], rtol=0, atol=1e-4)


def test_track_task_scores_reacquisitions_after_occlusions():
    task = task_config("track")
    b = task.sample(4, 150, _gen(1))
    assert b.tokens.shape == (4, 150, 17) and b.cands.shape == (4, 150, 7, 16)
    vis = b.visible
    torch.testing.assert_close(b.tokens[..., -1], vis.float())
    reacq = torch.zeros_like(vis)
    reacq[:, 1:] = vis[:, 1:] & ~vis[:, :-1]
    assert torch.equal(b.answer[:, :-1], reacq[:, 1:]) and reacq.any(-1).all()
    target = b.cands.gather(2, b.label[..., None, None].expand(-1, -1, 1, 16))[:, :, 0]
    cos = (target * b.tokens[..., :16]).sum(-1)
    assert (cos[vis] > 0.9).all() and (cos[~vis].abs() < 0.9).all()  # visible frames observe the target
    # the oracle that queries with the true next target is always right; the occluder is a candidate after
    out = torch.zeros(4, 150, 16)
    out[:, :-1] = target[:, 1:]
    assert (task.score(out, b) == 1).all()
    assert float(task.loss(out * 20, b)) < 0.05


# -- TS neuron ---------------------------------------------------------------------------------------------


def test_surrogate_gradient_matches_its_formula():
    u = torch.tensor([0.0, 0.49, 0.51, 0.99, 1.0, 1.2, 1.49, 1.51, 3.0], requires_grad=True)
    s = spike(u, 1.0, 1.0)
    assert torch.equal(s, (u >= 1.0).float().detach())  # forward: binary Heaviside
    (g,) = torch.autograd.grad(s.sum(), u)
    expected = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # 1[|u − 1| < 1/2] / 1
    torch.testing.assert_close(g, expected)
    u2 = torch.tensor([0.8, 1.3], requires_grad=True)
    (g2,) = torch.autograd.grad(spike(u2, 1.0, 0.5).sum(), u2)  # width 0.5: 1[|u − 1| < 0.25] / 0.5
    torch.testing.assert_close(g2, torch.tensor([2.0, 0.0]))


def test_ts_with_gamma_zero_is_bit_identical_to_lif():
    torch.manual_seed(0)
    lif = SpikingLayer(8, 0.5, 1.0, 1.0)
    ts = SpikingLayer(8, 0.5, 1.0, 1.0, trace=True, gamma=0.0)
    ts.fc.load_state_dict(lif.fc.state_dict())
    x = 2 * torch.randn(3, 20, 8)
    a, b = lif(x), ts(x)
    assert torch.equal(a, b) and a.sum() > 0
    ga = torch.autograd.grad(a.sum() + (a * x).sum(), lif.fc.weight)[0]
    gb = torch.autograd.grad(b.sum() + (b * x).sum(), ts.fc.weight)[0]
    assert torch.equal(ga, gb)
    with torch.no_grad():
        ts.gamma.fill_(0.5)
    assert not torch.equal(ts(x), a)  # the trace matters once γ ≠ 0


def test_lif_and_ts_follow_their_recurrences_by_hand():
    ts = SpikingLayer(1, 0.5, 1.0, 1.0, trace=True, beta=0.9, period=3, gamma=0.5)
    with torch.no_grad():
        ts.fc.weight.fill_(1.0)
        ts.fc.bias.zero_()
    cur = [0.6, 0.6, 0.0, 0.9, 0.2, 0.0, 0.0]
    ts.record = True
    x = torch.tensor(cur).view(1, 7, 1)
    s = ts(x)[0, :, 0].tolist()
    u = sp = m = 0.0
    us, ss, ms = [], [], []
    for t, i_t in enumerate(cur, start=1):
        u = 0.5 * u * (1 - sp) + i_t + 0.5 * m
        sp = float(u >= 1.0)
        m = 0.9 * m + 0.1 * u
        if t % 3 == 0:
            m = 0.0
        us.append(u)
        ss.append(sp)
        ms.append(m)
    assert s == ss and set(s) <= {0.0, 1.0}
    torch.testing.assert_close(torch.stack(ts.potentials).flatten(), torch.tensor(us))
    torch.testing.assert_close(torch.stack(ts.traces).flatten(), torch.tensor(ms))
    assert ts.traces[2].abs().max() == 0 and ts.traces[5].abs().max() == 0  # zero right after forgetting
    assert ts.traces[3].abs().max() > 0


@pytest.mark.parametrize("name", ["xor", "blobs"])
def test_spiking_tasks_and_plain_spiking_model(name):
    task = task_config(name)
    b = task.sample(8, 12, _gen(0))
    assert b.label.shape == (8,) and b.tokens.shape[:2] == (8, 12)
    cfg = TrainConfig(mixer="ts", task=name, train_len=12, steps=1, dim=16, n_layers=2)
    model = LabLM(cfg.model_config())
    assert not hasattr(model.blocks[0], "mlp") and isinstance(model.norm, torch.nn.Identity)
    out = model(b.tokens)
    assert out.shape == (8, 12, task.output_dim)
    assert ((task.score(out, b) == 0) | (task.score(out, b) == 1)).all()
    logits = torch.zeros(8, 12, task.output_dim)
    logits[torch.arange(8), :, b.label] = 1.0
    assert (task.score(logits, b) == 1).all()  # the readout picks the class the outputs favour


def test_xor_bursts_encode_the_bits():
    task = task_config("xor:noise=0,rate=1")
    b = task.sample(16, 16, _gen(0))
    x = b.tokens.view(16, 16, 4, 4)
    a_bit = x[:, 0].sum(-1)[:, :2].argmax(-1)
    b_bit = x[:, 4].sum(-1)[:, 2:].argmax(-1)
    assert torch.equal(b.label, a_bit ^ b_bit)
    assert x[:, 2:4].sum() == 0 and x[:, 6:].sum() == 0  # silent outside the bursts
    assert b.answer[:, 4:].all() and not b.answer[:, :4].any()


@pytest.mark.parametrize("spec,length", [("meg", 320), ("track", 80), ("xor", 9), ("blobs", 5),
                                         ("lorenz96:pool=4", 10)])
def test_other_modality_tasks_are_seeded_and_sized(spec, length):
    task = task_config(spec)
    a, b, c = (task.sample(3, length, _gen(s)) for s in (5, 5, 6))
    assert a.tokens.shape[:2] == (3, length) and a.answer.shape == (3, length)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert a.answer.any(dim=1).all()
    if task.input_dim:
        assert a.tokens.shape[2] == task.input_dim
    else:
        assert int(a.tokens.max()) < task.vocab_size
    with pytest.raises(LonglabError, match="length"):
        task.sample(1, task.min_length() - 1, _gen(0))


@pytest.mark.parametrize("mixer,task,train_len,lengths", [
    ("emformer", "lorenz96:n=8,pool=8,spinup=5", 9, [20]),
    ("crisscross", "meg", 320, [320, 640]),
    ("vlta", "track", 62, [62, 124]),
    ("ts", "xor", 8, [8, 16]),
])
def test_lab_eval_scores_the_new_tasks_like_a_direct_call(tmp_path, mixer, task, train_len, lengths):
    from longlab.lab.evaluate import eval_generator, evaluate

    train(TrainConfig(mixer=mixer, task=task, train_len=train_len, steps=2, dim=16, n_layers=1, n_heads=2,
                      batch=2), tmp_path / "ck", progress=False, log=None)
    rows = evaluate(tmp_path / "ck", lengths, out=tmp_path / "res", samples=2, batch=2, log=None)
    assert len(rows) == 2 * len(lengths)
    model, cfg, _ = load_checkpoint(tmp_path / "ck")
    tk = task_config(cfg.task)
    for r in rows:
        b = tk.sample(1, r["length"], eval_generator(0, r["length"], int(r["sample_id"])))
        with torch.no_grad():
            assert r["score"] == pytest.approx(float(tk.score(tk.predict(model, b.tokens), b)[0]), abs=1e-6)
    if task.startswith("lorenz96"):
        assert {"rmse@1", "rmse@5"} <= set(rows[0])


def test_lab_config_new_fields_are_checked():
    with pytest.raises(LonglabError, match="output_dim"):
        LabConfig(vocab_size=4, output_dim=-1)
    with pytest.raises(LonglabError, match="loss_params"):
        LabConfig(vocab_size=4, loss_params=(float("nan"),))
    with pytest.raises(LonglabError, match="positions"):
        LabConfig(vocab_size=4, mixer="crisscross", positions="alibi")
    with pytest.raises(LonglabError, match="tau"):
        mixer_config("lif:tau=2")
    with pytest.raises(LonglabError, match="beta"):
        mixer_config("ts:beta=1")


def test_ts_with_gamma_zero_from_the_registry_is_the_lif_model():
    """``ts:gamma=0`` (the trace adds γ·m = 0) built through the registry equals the ``lif`` lab model:
    outputs and the gradients of every shared weight; ``ts`` at its default γ does not."""
    cfg = {"vocab_size": 0, "input_dim": 16, "output_dim": 2, "dim": 16, "n_layers": 2, "n_heads": 1}
    torch.manual_seed(0)
    lif = LabLM(LabConfig(mixer="lif", positions="nope", **cfg))
    ts0 = LabLM(LabConfig(mixer="ts:gamma=0", positions="nope", **cfg))
    ts = LabLM(LabConfig(mixer="ts", positions="nope", **cfg))
    for m in (ts0, ts):
        missing, unexpected = m.load_state_dict(lif.state_dict(), strict=False)
        assert not unexpected and all(k.endswith("gamma") for k in missing)
    x = (torch.rand(4, 12, 16, generator=_gen(3)) < 0.3).float() * 3
    a, b = lif(x), ts0(x)
    assert torch.equal(a, b)
    ga = torch.autograd.grad(a.square().sum(), list(lif.parameters()))
    gb = torch.autograd.grad(b.square().sum(), [p for n, p in ts0.named_parameters() if "gamma" not in n])
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    assert not torch.equal(ts(x), a)


def _page_modalities(monkeypatch, tmp_path):
    """The page generator (longlab.eval.pages.modalities) reading its rows from ``tmp_path``."""
    from longlab.eval.pages import modalities as mod

    monkeypatch.setattr(mod, "_RESULTS", [tmp_path])
    return mod


def _bits(acc: float, n: int = 200) -> str:
    k = round(acc * n)
    return "1" * k + "0" * (n - k)


def _write(tmp_path, name: str, rows: list[dict]) -> None:
    import json

    (tmp_path / name).write_text(json.dumps({"experiment": name, "commands": {}, "rows": rows}))


def test_page_verdicts_follow_the_numbers_and_flip_when_the_data_flip(monkeypatch, tmp_path):
    """The page's verdicts are computed from the stored rows: a clear win reproduces, the same rows with
    the arms swapped do not reproduce, and a difference whose interval covers 0 is not significant."""
    mod = _page_modalities(monkeypatch, tmp_path)

    def meg(long_accs, short_accs):
        for s, (hi, lo) in enumerate(zip(long_accs, short_accs)):
            rows = [{"context": c, "seed": s, "encoder": e, "labels": 80, "correct": _bits(acc),
                     "final_loss": 1.0}
                    for c, acc in ((500, hi), (50, lo)) for e in ("pretrained", "untrained")]
            _write(tmp_path, f"meg_seed{s}.json", rows)
        return mod.claims_meg()[0].verdict

    assert meg([0.6, 0.65, 0.62], [0.4, 0.42, 0.41]) == "reproduces"
    assert meg([0.4, 0.42, 0.41], [0.6, 0.65, 0.62]) == "does not reproduce"
    assert meg([0.6, 0.4, 0.52], [0.5, 0.5, 0.5]) == "not significant"

    def ts(lif, ts_):  # accuracies at T = 4 and T = 64, per seed
        for s in range(3):
            rows = [{"neuron": n, "T": t, "seed": s, "correct": _bits(accs[i][s]), "grad_ratio": 1.0,
                     "grad_ratio_init": 1e24}
                    for n, accs in (("lif", lif), ("ts", ts_)) for i, t in enumerate((4, 64))]
            _write(tmp_path, f"ts_xor_seed{s}.json", rows)
        return mod.claims_ts("xor")[0]

    flat = ([0.95, 0.96, 0.97], [0.95, 0.96, 0.97])
    falls = ([0.95, 0.96, 0.97], [0.6, 0.62, 0.65])
    assert ts(falls, flat).verdict == "reproduces"
    assert ts(flat, falls).verdict == "does not reproduce"  # TS declines, LIF does not
    assert ts(flat, flat).verdict == "not significant"
    assert "∞" in ts(falls, flat).figures  # a zero ‖∂L/∂u_T‖ is shown as ∞, not 1e24

    def emf(d20, d1):  # rollout − one-step RMSE per seed at leads 20 and 40, and at lead 1
        for s in range(3):
            base = {"1": [0.1] * 4, "20": [0.8] * 4, "40": [1.2] * 4}
            roll = {"1": [0.1 + d1[s]] * 4, "20": [0.8 + d20[s]] * 4, "40": [1.2 + d20[s]] * 4}
            rows = [{"arm": "one-step@0.0001", "seed": s, "rmse": base},
                    {"arm": "rollout@0.0001", "seed": s, "rmse": roll}]
            _write(tmp_path, f"emformer_seed{s}.json", rows)
        return mod.claims_emformer()[0].verdict

    better, none = [-0.1, -0.12, -0.11], [0.0, 0.001, -0.001]
    assert emf(better, none) == "reproduces"
    assert emf([-d for d in better], none) == "does not reproduce"
    assert emf(better, [-d / 10 for d in better]) == "does not reproduce"  # lead 1 hurt
    assert emf([-0.1, 0.1, -0.02], none) == "not significant"
