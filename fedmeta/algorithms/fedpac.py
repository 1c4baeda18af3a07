"""FedPAC (Xu, Tong & Huang, "Personalized Federated Learning with Feature Alignment and
Classifier Collaboration", ICLR 2023).

The model is a feature extractor, shared and averaged as FedAvg's, and a linear classifier (the
head) per client. Each round a sampled client:

1. measures, with the extractor it received and before training, two statistics of its features
   z: its class-weighted means H_k[c] = p_k(c)·μ_k(c) (p_k: its label distribution, μ_k(c): the
   mean feature of class c) and a variance term V_k = (Σ_c p_k(c)·E_c‖z‖² − p_k(c)²·‖μ_k(c)‖²) / n_k;
2. trains its head alone for ``head_epochs`` (the extractor fixed);
3. trains the extractor alone for ``local_epochs`` (its head fixed) on its cross-entropy plus
   λ times the squared distance between each sample's feature and its class's global centroid
   (the feature alignment), and sends its extractor, its head, its class centroids and counts,
   and V_k, H_k.

The server averages the extractors (by sample count); each class's global centroid is the
count-weighted mean of the clients' centroids of that class. Then, for each of the round's
clients i, it combines the round's heads: α_i minimizes αᵀ(diag(V) + D_i)α over the simplex, with
D_i[j, l] = Σ_c (H_i[c] − H_j[c])·(H_i[c] − H_l[c]) — a bias term (how far the other clients'
features are from i's) traded against a variance term — and client i's next head is
Σ_j α_ij·head_j / Σ_j α_ij, weights under 10⁻³ dropped as in the authors' code.

As implemented, and where fedmeta's protocol decides what the paper leaves open (the authors'
code, JianXu95/FedPAC, read for each):
- Local training: SGD at the protocol's ``local_lr`` for both phases (``head_lr`` for the head;
  the authors' code: 0.1 for the head, 0.01 for the extractor, momentum 0.5 and weight decay
  5·10⁻⁴), ``head_epochs`` = 1 as theirs. The alignment is their mean squared error over a batch's
  samples and feature units, λ = 1 (``method.lam``); a class with no global centroid yet is
  aligned to the client's own centroid measured in step 1, as theirs, and in the first round
  (no global centroid at all) there is no alignment term, as theirs.
- The statistics and centroids are one pass over all the client's data (the centroids after
  training, with the trained extractor), as theirs.
- The combination's quadratic program is solved exactly in float64 (theirs: CVXPY): with the few
  clients of a round, every support is tried — its equality-constrained minimum is one linear
  system — and the best nonnegative one kept (``simplex_qp``; SciPy's SLSQP beyond 12 clients).
  Its matrix is positive semi-definite by construction (a diagonal of variances plus a Gram
  matrix), so their eigenvalue repair is not needed; a matrix with a non-finite entry leaves the
  client its own head, as a failed solve does in theirs. The server holds the combined heads
  (``heads``, part of the federation state) and sends each client its own (``broadcast_state``;
  on Flower, in the message to its node).
- A client that has no combined head yet starts from the global head: the average of the round's
  heads (the authors' code averages every parameter into its global model, the head too, but
  gives each client's model only the extractor).
- Clients are sampled (5 a round here): the combination weighs the round's clients, as the
  authors' code with ``frac`` < 1.
- Evaluation: new clients are scored (the paper's protocol). A new client starts from the global model (averaged
  extractor and head) and personalizes with the shared procedure on FedPAC's loss with the
  global centroids.
"""

from __future__ import annotations

import numpy as np
import torch

from fedmeta.algorithms.base import ClientData, ClientUpdate, LocalResult
from fedmeta.algorithms.fedavg import FedAvg
from fedmeta.algorithms.fedproto import HELD, PROTOTYPE, FedProto
from fedmeta.data.federation import Client
from fedmeta.functional import Params
from fedmeta.models import CLASSIFIER

COUNT, VARIANCE, BIAS = "prototype.count", "statistics.variance", "statistics.means"
SMALLEST_WEIGHT = 1e-3  # combination weights below it are dropped (the authors' code's eps)


EXACT_CLIENTS = 12  # up to this many clients a round the combination tries every support (2^m − 1 of them)


def simplex_qp(matrix: np.ndarray) -> np.ndarray | None:
    """argmin αᵀ·matrix·α over the probability simplex, for a positive semi-definite ``matrix``;
    None when it holds a non-finite entry.

    Exact for up to ``EXACT_CLIENTS`` clients: the minimum lies on some support S (the clients with
    α > 0), where it is the minimum over the plane Σα = 1 of those clients alone — the solution of
    one linear system (the KKT conditions 2·Q_SS·α_S = ν·1, Σα_S = 1). Every support's system is
    solved at once (least squares: a singular one still gives a minimizer), the solutions with no
    negative weight are kept, and the one of least objective is the minimum. Beyond that many
    clients: SciPy's SLSQP, whose absolute tolerances can stop early on near-degenerate problems."""
    if not np.isfinite(matrix).all():
        return None
    m = len(matrix)
    matrix = matrix / max(np.abs(matrix).max(), np.finfo(np.float64).tiny)  # the argmin is scale-free
    if m > EXACT_CLIENTS:
        return _slsqp(matrix)
    supports = (np.arange(1, 2**m)[:, None] >> np.arange(m)) & 1 == 1  # (2^m − 1) × m
    systems = np.zeros((len(supports), m + 1, m + 1))
    inside = supports[:, :, None]
    systems[:, :m, :m] = np.where(inside, 2 * matrix, np.eye(m))  # S's stationarity; α_j = 0 off S
    systems[:, :m, m] = -supports.astype(np.float64)  # − ν on S's rows
    systems[:, m, :m] = 1.0  # Σα = 1
    rhs = np.zeros((len(supports), m + 1, 1))
    rhs[:, m] = 1.0
    alphas = (np.linalg.pinv(systems, rcond=1e-13) @ rhs)[:, :m, 0]
    alphas = np.where(supports, alphas, 0.0)
    feasible = (alphas >= -1e-12).all(1) & (np.abs(alphas.sum(1) - 1) < 1e-9)
    alphas = np.clip(alphas[feasible], 0.0, None)
    alphas /= alphas.sum(1, keepdims=True)
    objectives = np.einsum("si,ij,sj->s", alphas, matrix, alphas)
    return alphas[np.argmin(objectives)]


def _slsqp(matrix: np.ndarray) -> np.ndarray | None:
    # imported here: no other method needs scipy, and the GPU job's kit carries only what it imports
    from scipy.optimize import minimize

    m = len(matrix)
    solution = minimize(
        lambda a: a @ matrix @ a,
        np.full(m, 1.0 / m),
        jac=lambda a: 2 * matrix @ a,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * m,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones(m)}],
        options={"ftol": 1e-12, "maxiter": 200},
    )
    return solution.x if solution.success else None


class FedPAC(FedProto):
    def __init__(self, model, cfg, precision=None):
        super().__init__(model, cfg, precision)
        self.head_names, self.body_names = self.split_names((CLASSIFIER,))
        self.heads: dict[int, Params] = {}  # client id → the head the server combined for it

    def draw(self, client: Client, round_: int) -> ClientData:
        cfg, generator = self.cfg, client.generator(round_)
        reshuffle = cfg.shuffle == "every_epoch"
        return {
            "head": client.epochs(
                cfg.train_split, cfg.batch_size, generator, cfg.head_epochs, cfg.drop_last, reshuffle
            ),
            "epochs": client.epochs(
                cfg.train_split, cfg.batch_size, generator, cfg.local_epochs, cfg.drop_last, reshuffle
            ),
            "all": client.batch(cfg.train_split, None),
        }

    def client_state(self, client_id: int, params: Params) -> dict:
        head = self.heads.get(client_id, {n: params[n] for n in self.head_names})
        like = params[CLASSIFIER + "weight"]  # the parameters' dtype and device
        return {
            "head": {n: head[n].to(like) for n in self.head_names},
            "prototypes": {k: v.to(like) for k, v in self.prototypes.items()},
        }

    def kept_model(self, params: Params, state: dict) -> Params:
        return {**params, **state["head"], **state["prototypes"]}  # the head the server combined for it

    def local_update(self, params: Params, state: dict, data: ClientData) -> LocalResult:
        cfg, prototypes = self.cfg, state["prototypes"]
        params = {**params, **state["head"]}
        means, counts, square_norms = self.class_means(params, data["all"])
        share = counts / counts.sum()
        variance = (share * square_norms - share**2 * (means**2).sum(-1)).sum() / counts.sum()
        params, _ = self.local_sgd(params, data["head"], cfg.head_lr, cfg.momentum, trainable=self.head_names)
        # each class's global centroid, or the client's own where there is none; none in round one
        targets = {
            PROTOTYPE: torch.where(prototypes[HELD].unsqueeze(-1) > 0, prototypes[PROTOTYPE], means),
            HELD: torch.ones_like(prototypes[HELD]) * (prototypes[HELD].sum() > 0),
        }
        params, loss = self.local_sgd(
            params,
            data["epochs"],
            cfg.local_lr,
            cfg.momentum,
            trainable=self.body_names,
            objective=lambda w, batch: self.prototype_loss(w, batch, targets),
        )
        centroids, counts, _ = self.class_means(params, data["all"])
        sent = {
            **params,
            PROTOTYPE: centroids,
            COUNT: counts,
            VARIANCE: variance,
            BIAS: share.unsqueeze(-1) * means,
        }
        return LocalResult(sent, loss, {}, {})

    def to_update(self, client: Client, result: LocalResult) -> ClientUpdate:
        return FedAvg.to_update(self, client, result)  # everything it trained and measured; it keeps nothing

    def aggregate(self, updates: list[ClientUpdate]) -> None:
        """The extractor and the global head: FedAvg's mean; the global centroids: count-weighted;
        each client's next head: the combination of the round's heads its quadratic program picks."""
        FedAvg.aggregate(self, updates)
        if not updates:
            return
        self.update_prototypes(updates, COUNT)
        dtype = torch.promote_types(updates[0].params[PROTOTYPE].dtype, torch.float32)
        variances = np.array([float(u.params[VARIANCE]) for u in updates])
        means = torch.stack([u.params[BIAS].double().flatten().cpu() for u in updates]).numpy()
        for i, update in enumerate(updates):
            gaps = means[i] - means  # clients × (C·units)
            alpha = simplex_qp(np.diag(variances) + gaps @ gaps.T)
            if alpha is None:
                self.heads[update.client_id] = {n: update.params[n].clone() for n in self.head_names}
                continue
            alpha = np.where(alpha > SMALLEST_WEIGHT, alpha, 0.0)
            weights = torch.tensor(alpha / alpha.sum(), dtype=dtype)
            self.heads[update.client_id] = {
                n: torch.tensordot(
                    weights.to(update.params[n].device),
                    torch.stack([u.params[n].to(dtype) for u in updates]),
                    dims=1,
                ).to(update.params[n].dtype)
                for n in self.head_names
            }

    # ---- new clients: the global model, FedPAC's loss with the global centroids (FedProto's) ----
    def broadcast_state(self, client_id: int) -> Params:
        head = self.heads.get(client_id, {})
        return {**self.prototypes, **{"combined." + n: t for n, t in head.items()}}

    def load_broadcast_state(self, tensors: Params, client_id: int) -> None:
        self.prototypes = {k: tensors[k] for k in (PROTOTYPE, HELD)}
        head = {n: tensors["combined." + n] for n in self.head_names if "combined." + n in tensors}
        self.heads = {client_id: head} if head else {}

    def federation_state(self) -> dict:
        return {**super().federation_state(), "heads": self.heads}

    def load_federation_state(self, state: dict) -> None:
        super().load_federation_state(state)
        self.heads = dict(state["heads"])
