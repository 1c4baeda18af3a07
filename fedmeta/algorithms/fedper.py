"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary 2019, "Federated Learning with Personalization
Layers", arXiv:1912.00818): the base layers are shared and averaged by the server as in FedAvg;
the personalization layers stay with each client. A sampled client trains base and
personalization layers together — its own personalization layers on the round's global base —
for FedAvg's local epochs, sends the base only and keeps its personalization layers.

``method.personal`` chooses the personalization layers: ``classifier`` (the last linear layer)
or ``fc_block`` (the dense layers and the classifier: the top two layers). The paper varies their
number (the top one to four layers of its networks); this CNN has two fully connected layers.

Protocol choices the paper does not make: a client that has not taken part yet starts from the
global personalization layers, which the server never averages — so they stay at their
initialization (the paper does not say how a client's personalization layers start). Only new
clients are evaluated here, and the paper defines no procedure for them: a new client starts from
the trained base and those initial personalization layers and fine-tunes all layers with the
shared procedure (as FL-bench's FedPer fine-tunes its full model).

The mechanism — some layers kept per client, trained jointly with the shared ones — is FedAvg's
local update on the client's own copy of those layers, whatever FedAvg's options (its kept Adam,
its persistent iterator); LG-FedAvg and FedBN reuse it with other layers kept.
"""

from __future__ import annotations

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.data.federation import Client
from fedmeta.functional import Params
from fedmeta.models import CLASSIFIER, DENSE

# method.personal: the last Linear, or the whole fully connected block (dense layers and classifier)
LAYERS = {"classifier": (CLASSIFIER,), "fc_block": (DENSE, CLASSIFIER)}


class FedPer(FedAvg):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        # own: each client's copy, never sent; shared: sent and averaged
        self.own_names, self.shared_names = self.own_and_shared()

    def own_and_shared(self) -> tuple[list[str], list[str]]:
        """The names of the parameters that stay with each client, and of those the server averages."""
        return self.split_names(LAYERS[self.cfg.personal])

    def client_state(self, client_id: int, params: Params) -> dict:
        return {
            "fedavg": super().client_state(client_id, params),  # FedAvg's own (its kept Adam), if any
            "own": self.kept_params(client_id, params, self.own_names),
        }

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["own"]}

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        result = super().local_update({**params, **state["own"]}, state["fedavg"], data)
        return LocalResult(
            {n: result.params[n] for n in self.shared_names},
            result.loss,
            {"fedavg": result.state, "own": {n: result.params[n] for n in self.own_names}},
            {},
        )

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        update = super().to_update(client, result._replace(state=result.state["fedavg"]))
        update.state = {**(update.state or {}), **self.keep(result.state["own"], self.own_names)}
        return update
