"""Token mixers of the layers lab; importing this package registers all of them in ``MIXERS``."""

from . import crisscross, ema, emformer, l2a, lact, lssa, race, recurrent, softmax, spiking, ultramem, vlta  # noqa: F401  (registration)
from .base import MIXERS, AttnMixer, MixerConfig, MixerModule, mixer_config, register_mixer

__all__ = ["MIXERS", "AttnMixer", "MixerConfig", "MixerModule", "mixer_config", "register_mixer"]
