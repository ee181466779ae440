"""Invariant 4: chunked prefill + compression never materialises an n x n matrix.

At n = 65,536 tokens an n x n fp32 score matrix for the tiny model's 4 heads needs 64 GiB, more
than this machine has; prefill + compression must stay far below that."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource, sys, torch
from longlab.models import build_tiny_model
from longlab.cache import LonglabCache
from longlab.engine.stream import Stream
torch.manual_seed(0)
model = build_tiny_model("tiny-llama")
n = int(sys.argv[2])
stream = Stream(model, LonglabCache(sys.argv[1]), 1)
stream.feed([torch.randint(0, 256, (n,)).tolist()], chunk_size=2048)
held = max(int(x.max()) for x in stream.cache.lengths())
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "held": held,
                  "seen": stream.cache.get_seq_length()}))
"""


@pytest.mark.parametrize(
    "recipe", ["snapkv:budget=512", pytest.param("h2o:budget=512", marks=pytest.mark.slow)]
)
def test_prefill_and_compression_memory_is_linear_not_quadratic(recipe):
    n = 65536
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, recipe, str(n)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["seen"] == n
    assert stats["held"] == 512
    n_squared_gib = n * n * 4 * 4 / 2**30  # 64 GiB
    assert stats["peak_mb"] < 3 * 1024, stats  # < 3 GiB, vs n^2 scores of {n_squared_gib:.0f} GiB
    assert n_squared_gib > 24
