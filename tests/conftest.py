"""Shared fixtures: tiny random models built in code (session-scoped), never downloaded."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")


@pytest.fixture(scope="session")
def tokenizer():
    from longlab.models import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_models():
    """name -> (longlab model, sdpa reference with the same weights)."""
    from longlab.models import build_tiny_model

    return {name: (build_tiny_model(name), build_tiny_model(name, attn="sdpa")) for name in TINY}


@pytest.fixture(scope="session")
def llama(tiny_models):
    return tiny_models["tiny-llama"][0]


@pytest.fixture
def text():
    return " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(60))


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads; on a busy 2-core machine 2 threads run ~10x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
