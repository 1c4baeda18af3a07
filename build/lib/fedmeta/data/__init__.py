"""Data layer: canonical sources → image data sets → partitions → clients."""

from fedmeta.data.datasets import ImageDataset, load_dataset
from fedmeta.data.federation import Batch, Client, Federation, build_federation

__all__ = ["Batch", "Client", "Federation", "ImageDataset", "build_federation", "load_dataset"]
