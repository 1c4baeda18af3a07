"""Data layer: canonical sources → image data sets → partitions → clients."""

from fedmeta.data.datasets import ImageDataset, load_dataset
from fedmeta.data.federation import Client, Federation, build_federation

__all__ = ["Client", "Federation", "ImageDataset", "build_federation", "load_dataset"]
