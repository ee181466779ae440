"""Synthetic tasks of the layers lab: seeded generators with exact answers (or exact next-token
distributions), any length. One task per module, each registered by name in ``LAB_TASKS``; the extension
point (:class:`Batch`, :class:`Task`, :func:`register_task`, :func:`task_config`) is in :mod:`.base`.

Registered (``LAB_TASKS``; importing this package imports every task module):

- ``copy`` (:mod:`.copy`), ``mqar`` (:mod:`.mqar`), ``passkey`` (:mod:`.passkey`), ``flipflop``
  (:mod:`.flipflop`): recall with exact answers;
- ``mtd`` (:mod:`.mtd`): mixture of transition distributions with the Bayes-optimal predictor;
- ``algebra`` (:mod:`.algebra`): in-context group arithmetic and its mechanism test sets;
- ``pcfg`` (:mod:`.pcfg`): PCFG strings with the exact next-token distribution;
- ``lcube`` (:mod:`.lcube`): L-CUBE continuous sequences with the exact conditional;
- ``lorenz96`` (:mod:`.lorenz96`): Lorenz-96 forecasting (EMFormer's proxy), rollout training;
- ``meg`` (:mod:`.meg`): a 16-channel switching-state token signal, MEG-XL's block-masked pretraining;
- ``track`` (:mod:`.track`): a drifting target through occlusions (TAPTRv3's VLTA proxy);
- ``xor`` (:mod:`.xor`), ``blobs`` (:mod:`.blobs`): spike-train and repeated-input classification over
  T timesteps (the TS neuron's tasks).
"""

from __future__ import annotations

from .algebra import GROUPS, QUERIES, AlgebraTask, cayley_table, group_order
from .base import (
    IGNORE,
    LAB_TASKS,
    Batch,
    ClassBatch,
    Task,
    TimeClassTask,
    kl_per_position,
    register_task,
    task_config,
)
from .blobs import BlobsTask
from .copy import CopyTask
from .flipflop import FlipFlopTask
from .lcube import LCubeTask
from .lorenz96 import Lorenz96Task
from .meg import MEGTask
from .mqar import MQARTask
from .mtd import MTDTask, mirror_descent
from .passkey import PasskeyTask
from .pcfg import PCFGBatch, PCFGTask
from .track import TrackBatch, TrackTask
from .xor import XORTask

__all__ = [
    "GROUPS",
    "IGNORE",
    "QUERIES",
    "LAB_TASKS",
    "AlgebraTask",
    "Batch",
    "BlobsTask",
    "ClassBatch",
    "CopyTask",
    "FlipFlopTask",
    "LCubeTask",
    "Lorenz96Task",
    "MEGTask",
    "MQARTask",
    "MTDTask",
    "PCFGBatch",
    "PCFGTask",
    "PasskeyTask",
    "Task",
    "TrackBatch",
    "TimeClassTask",
    "TrackTask",
    "XORTask",
    "cayley_table",
    "group_order",
    "kl_per_position",
    "mirror_descent",
    "register_task",
    "task_config",
]
