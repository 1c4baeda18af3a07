"""fedmeta: personalized federated learning with meta-learning on Lightning Fabric."""
