"""Models: the base CNN f_ψ and the federated modulator g_μ."""

from fedmeta.models.cnn import CLASSIFIER, DENSE, ConvNet, ConvStackError, build_base_net, set_channels_last
from fedmeta.models.footprint import refuse_oversized
from fedmeta.models.modulator import MODULATIONS, ModulatedNet, Modulator, modulate

__all__ = [
    "CLASSIFIER",
    "DENSE",
    "MODULATIONS",
    "ConvNet",
    "ConvStackError",
    "ModulatedNet",
    "Modulator",
    "build_base_net",
    "modulate",
    "refuse_oversized",
    "set_channels_last",
]
