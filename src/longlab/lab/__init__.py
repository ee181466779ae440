"""The layers lab: one small trainable LM with swappable token mixers, synthetic tasks with exact
answers, a CPU trainer and a train-short/test-long evaluation into the results store.

See :mod:`longlab.lab.mixers` (registered mixers), :mod:`longlab.lab.tasks` (registered tasks),
:mod:`longlab.lab.train` and :mod:`longlab.lab.evaluate`; the CLI is ``longlab lab train|eval``.
"""

from .mixers import MIXERS, MixerConfig, mixer_config, register_mixer
from .model import LabConfig, LabLM, match_mlp_hidden
from .positions import LAB_POSITIONS, Positions

__all__ = [
    "MIXERS",
    "LAB_POSITIONS",
    "LabConfig",
    "LabLM",
    "MixerConfig",
    "Positions",
    "match_mlp_hidden",
    "mixer_config",
    "register_mixer",
]
