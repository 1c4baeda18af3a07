"""FedBN (Li, Jiang, Zhang, Kamp & Dou, ICLR 2021, "FedBN: Federated Learning on Non-IID Features
via Local Batch Normalization"): FedAvg in which the batch-norm layers stay with each client — a
client trains all its parameters for FedAvg's local epochs, sends all but its batch-norm weights
and biases, and keeps those; the server averages the rest.

fedmeta's models normalize with batch statistics only (``track_running_stats=False``: no running
means or variances), so the part of FedBN that keeps each client's statistics local holds by
construction: every batch is normalized with its own statistics, in training and at test time.
What FedBN keeps per client here is the batch-norm affine parameters (1,216 numbers on RMNIST).

Protocol choices the paper does not make: its clients all take part in every round and it
evaluates only those clients; here a client that has not taken part yet starts from the global
batch-norm parameters, which the server never averages — their initialization (weight 1, bias 0;
FL-bench starts its clients the same way). A new client starts from the trained shared layers
and those initial batch-norm parameters; as FedBN has each client's own batch norm absorb its
feature shift on the shared layers, the first ``test_bn_steps`` personalization steps of the
shared procedure train the batch-norm parameters alone, the rest all layers (0: all layers from
the first step).
"""

from __future__ import annotations

from torch.nn.modules.batchnorm import _BatchNorm

from fedmeta.algorithms.fedper import FedPer
from fedmeta.errors import FedmetaError


class FedBN(FedPer):
    def own_and_shared(self) -> tuple[list[str], list[str]]:
        norms = tuple(f"{name}." for name, m in self.model.named_modules() if isinstance(m, _BatchNorm))
        if not norms:
            raise FedmetaError(
                "FedBN keeps each client's batch norms, and this model has none (model.batch_norm=false, "
                "model.norm=group or model.kind=lstm): choose a model with batch norms, or another method"
            )
        return self.split_names(norms)

    def adapted_names(self, step: int) -> list[str] | None:
        return self.own_names if step < self.cfg.test_bn_steps else None
