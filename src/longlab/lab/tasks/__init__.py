"""Synthetic tasks of the layers lab: seeded generators with exact answers (or exact next-token
distributions), any length. One task per module, each registered by name in ``TASKS``; the extension
point (:class:`Batch`, :class:`Task`, :func:`register_task`, :func:`task_config`) is in :mod:`.base`.

Registered (``TASKS``; importing this package imports every task module):

- ``copy`` (:mod:`.copy`), ``mqar`` (:mod:`.mqar`), ``passkey`` (:mod:`.passkey`), ``flipflop``
  (:mod:`.flipflop`): recall with exact answers;
- ``mtd`` (:mod:`.mtd`): mixture of transition distributions with the Bayes-optimal predictor;
- ``algebra`` (:mod:`.algebra`): in-context group arithmetic and its mechanism test sets;
- ``pcfg`` (:mod:`.pcfg`): PCFG strings with the exact next-token distribution;
- ``lcube`` (:mod:`.lcube`): L-CUBE continuous sequences with the exact conditional.
"""

from __future__ import annotations

from .algebra import GROUPS, QUERIES, AlgebraTask, cayley_table, group_order
from .base import IGNORE, TASKS, Batch, Task, kl_per_position, register_task, task_config
from .copy import CopyTask
from .flipflop import FlipFlopTask
from .lcube import LCubeTask
from .mqar import MQARTask
from .mtd import MTDTask, mirror_descent
from .passkey import PasskeyTask
from .pcfg import PCFGBatch, PCFGTask

__all__ = [
    "GROUPS",
    "IGNORE",
    "QUERIES",
    "TASKS",
    "AlgebraTask",
    "Batch",
    "CopyTask",
    "FlipFlopTask",
    "LCubeTask",
    "MQARTask",
    "MTDTask",
    "PCFGBatch",
    "PCFGTask",
    "PasskeyTask",
    "Task",
    "cayley_table",
    "group_order",
    "kl_per_position",
    "mirror_descent",
    "register_task",
    "task_config",
]
