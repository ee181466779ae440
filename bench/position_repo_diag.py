"""Why RePo's 10-step fine-tune did not move the loss (issue 28): train only the RePo modules of SmolLM2-135M
on one fixed 256-token essay window for 12 AdamW steps at lr 1e-3 (the page's old setting) and at 1e-2,
printing each step's loss, the held-out loss, the gradient norms of W_f and W_g, and how far the learned
positions moved (|δ| mean and max over the window's tokens and KV heads).

    bench/heavy.sh env PYTHONPATH=src .venv/bin/python bench/position_repo_diag.py \\
        > bench/results/position/repo_diag.log

Output (2026-12-06 02:3x UTC, one thread, load ~1.6): bench/results/position/repo_diag.log.
"""

from __future__ import annotations

import time

import torch


def main() -> None:
    from longlab.models import load_model
    from longlab.position.train import training_windows
    from longlab.position.variants import trainable_parameters

    seq = 256
    for lr in (1e-3, 1e-2):
        model, tok = load_model("smollm2-135m", attn_implementation="sdpa", position="repo")
        params = trainable_parameters(model, "added")
        for p in model.parameters():
            p.requires_grad_(False)
        for _, p in params:
            p.requires_grad_(True)
        w = training_windows(tok, seq, 1)
        held = training_windows(tok, seq, 1, seed=1, split="held-out")
        opt = torch.optim.AdamW([p for _, p in params], lr=lr, weight_decay=0.0)
        model.train()
        deltas: dict[int, torch.Tensor] = {}

        def grab(mod, args, kwargs, deltas=deltas):
            h = kwargs.get("hidden_states", args[0] if args else None)
            deltas[id(mod)] = mod.longlab_repo(h).detach()  # δ [B, T, H_kv]

        hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True)
                 for layer in model.model.layers[5:]]
        t0 = time.time()
        for step in range(12):
            loss = model(w, labels=w).loss
            opt.zero_grad()
            loss.backward()
            gf = sum(p.grad.norm() ** 2 for n, p in params if "w_f" in n) ** 0.5
            gg = sum(p.grad.norm() ** 2 for n, p in params if "w_g" in n) ** 0.5
            opt.step()
            d = torch.cat([v.abs().flatten() for v in deltas.values()])
            with torch.no_grad():
                model.eval()
                hl = model(held, labels=held).loss.item()
                model.train()
            print(f"lr {lr} step {step} loss {loss.item():.4f} held {hl:.4f} |gWf| {gf:.2e} |gWg| {gg:.2e} "
                  f"|delta| mean {d.mean():.3e} max {d.max():.3e} {time.time() - t0:.0f}s", flush=True)
        for h in hooks:
            h.remove()


if __name__ == "__main__":
    main()
