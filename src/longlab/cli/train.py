"""``longlab train indexmem|drope|ropeid|repo``: train a learned method's weights."""

from __future__ import annotations

from typing import Any

__all__ = ["add_train_parser"]


def add_train_parser(sub: Any) -> None:
    from ..kv.indexmem_train import add_train_arguments, train_main
    from ..position.train import TRAINABLE, add_position_train_arguments, position_train_main

    t = sub.add_parser("train", help="train a learned method's weights (IndexMem; DroPE, RoPE-ID, RePo)")
    add_train_arguments(t)
    add_position_train_arguments(t)  # adds drope, ropeid, repo (longlab.position)
    t.set_defaults(func=lambda a: position_train_main(a) if a.method in TRAINABLE else train_main(a))
