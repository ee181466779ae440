"""Token mixers of the layers lab, one per file, registered in the one registry (family ``mixer``; the
list of files is :mod:`longlab.methods`)."""

from .base import MIXERS, AttnMixer, MixerConfig, MixerModule, mixer_config, register_mixer

__all__ = ["MIXERS", "AttnMixer", "MixerConfig", "MixerModule", "mixer_config", "register_mixer"]
