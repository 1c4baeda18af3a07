"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency 2020, "Think
Locally, Act Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523;
NeurIPS 2019 FL workshop): FedPer's split reversed — each client keeps its own local
representation (the lower layers), and only the global model on top of it (the top layers) is
sent and averaged. A sampled client trains its local representation and the round's global
layers together for FedAvg's local epochs, sends the global layers and keeps the rest.

``method.global_layers`` chooses the global part: ``classifier`` (the last linear layer; the conv
and dense layers are local) or ``fc_block`` (the dense layers and the classifier; the conv layers
are local). The paper's MNIST MLP makes its top three of five layers global.

Protocol choices the paper does not make: the authors' code starts every client's local model
from a FedAvg-trained model (``--load_fed``), which ``model.init_from=<a FedAvg run>`` reproduces;
from scratch (fedmeta's default) a client that has not taken part yet starts from the global
representation, which the server never averages — its initialization. A new client starts from
the trained global layers and that initial representation and, as the paper has new devices do,
learns a local representation of its own under the fixed global layers: the first
``test_local_steps`` personalization steps of the shared procedure train the local layers only;
the remaining steps train every layer, as all methods' new clients do here (FedRep's head-first
steps, mirrored). ``test_local_steps`` ≥ ``personalization.steps``: the paper's procedure taken
literally — the global layers are never fine-tuned.
"""

from __future__ import annotations

from fedmeta.algorithms.fedper import LAYERS, FedPer


class LGFedAvg(FedPer):
    def own_and_shared(self) -> tuple[list[str], list[str]]:
        global_part, local = self.split_names(LAYERS[self.cfg.global_layers])
        return local, global_part

    def adapted_names(self, step: int) -> list[str] | None:
        return self.own_names if step < self.cfg.test_local_steps else None
