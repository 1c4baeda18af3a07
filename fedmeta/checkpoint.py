"""One checkpoint holds the whole federation state: the global model(s) and any per-client state
(``Algorithm.federation_state``), the round, every random-number generator and the metrics so far.

It is written every ``federation.checkpoint_every`` rounds and at the end, atomically (a temporary
file, then a rename), so a run killed at any moment leaves the last complete checkpoint; with
``output.resume=true`` a run continues from it and ends exactly as if it had never stopped.
"""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from omegaconf import DictConfig, OmegaConf

from fedmeta.errors import FedmetaError, atomic_write, write_failure

if TYPE_CHECKING:  # a run's identity (grid, campaign, collect) is read without PyTorch or Lightning
    from lightning_fabric import Fabric

    from fedmeta.algorithms import Algorithm

# Settings a run may change when it resumes: how long, how often, how fast — not what it computes.
RESUMABLE = {
    "federation": {
        "rounds",
        "eval_every",
        "checkpoint_every",
        "checkpoint_minutes",
        "client_threads",
        "vectorize",
        "vectorize_lanes",
        "lane_buckets",
        "capture",
    }
}
IDENTITY = ("seed", "dataset", "partition", "method", "variant", "model", "federation", "personalization")


def identity(cfg: DictConfig) -> dict:
    """What must match between a checkpoint and the run that resumes from it."""
    container = OmegaConf.to_container(cfg, resolve=True)
    ident = _settled({key: container.get(key) for key in IDENTITY})
    ident["dataset"] = {k: v for k, v in ident["dataset"].items() if k not in ("dir", "download")}
    protocol = (container.get("evaluation") or {}).get("protocol", "new_clients")
    selected = (container.get("personalization") or {}).get("lr_rule") == "selected"
    # training clients then keep a test split out of their training data (fedmeta.data.keeps_test_splits)
    if protocol != "new_clients" or selected:
        ident["evaluation"] = {"training_clients_test_split": True}
    return ident


def _settled(ident: dict) -> dict:
    """``ident`` without the settings a run may change when it resumes (``RESUMABLE``)."""
    return ident | {
        section: {k: v for k, v in ident[section].items() if k not in keys}
        for section, keys in RESUMABLE.items()
        if isinstance(ident.get(section), dict)
    }


def identity_differences(saved: dict, cfg: DictConfig) -> list[str]:
    """Where the identity a checkpoint saved differs from ``cfg``'s run: a setting that counted when
    it was written and may change on resume now (``RESUMABLE``) is no difference."""
    return differences(_settled(saved) if isinstance(saved, dict) else saved, identity(cfg))


def _rng_states() -> dict:
    import torch

    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_rest": [int(numpy_state[2]), int(numpy_state[3]), float(numpy_state[4])],
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_states(states: dict) -> None:
    import torch

    torch.set_rng_state(states["torch"])
    pos, has_gauss, cached = states["numpy_rest"]
    np.random.set_state(("MT19937", states["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save(
    fabric: Fabric, path: Path, algorithm: Algorithm, cfg: DictConfig, round_: int, history: dict
) -> None:
    """Write the checkpoint of the state after ``round_`` (all ranks call this; rank 0 writes)."""
    state = {
        "round": round_,
        "identity": identity(cfg),
        "precision": str(cfg.fabric.precision),
        "federation": algorithm.federation_state(),
        "rng": _rng_states(),
        "history": history,
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        fabric.save(tmp, state)
        if fabric.is_global_zero:
            os.replace(tmp, path)  # atomic: the old checkpoint stays whole until the new one is
    except OSError as exc:  # a full disk: Lightning's error names its own temporary file
        raise write_failure(path, tmp, exc) from None
    fabric.barrier()


MODEL = "model.pt"  # a finished run's final state, compact, for re-scoring (``fedmeta evaluate``)
MODEL_DTYPES = ("float32", "float16", "bfloat16")


def save_model(path: Path, algorithm: Algorithm, cfg: DictConfig) -> dict:
    """What re-scoring a finished run reads — its global model, the method's other server state
    (IFCA's models, FedPAC's heads, FedProto's prototypes, …) and, for a method that keeps a model per
    client, the client states the training-clients protocol scores — in ``output.keep_model``'s float
    type (a tensor that type cannot hold finite stays float32), within ``output.keep_model_mib``: past
    it, the per-client states go first, then the largest other parts (training-only state such as
    SCAFFOLD's control variates), and the file names what it left out. Returns what it wrote."""
    import torch

    dtype = getattr(torch, cfg.output.keep_model)

    def compact(tree):
        if isinstance(tree, dict):
            return {key: compact(value) for key, value in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(compact(value) for value in tree)
        if isinstance(tree, torch.Tensor) and tree.is_floating_point():
            small = tree.detach().to("cpu", dtype)
            return (
                small if bool(torch.isfinite(small).all() or not torch.isfinite(tree).all()) else tree.cpu()
            )
        return tree.cpu() if isinstance(tree, torch.Tensor) else tree

    state = algorithm.federation_state()
    if not algorithm.keeps_client_models:
        state.pop("client_states", None)  # training-only (an optimizer's moments): no score reads them
    model = compact(state["model"])
    parts = {key: compact(value) for key, value in state.items() if key != "model"}
    sizes = {key: len(_bytes(value)) for key, value in parts.items()}
    left_out = []
    limit = cfg.output.keep_model_mib * 2**20
    total = len(_bytes(model)) + sum(sizes.values())
    for key in sorted(parts, key=lambda k: (k != "client_states", -sizes[k])):
        if total <= limit:
            break
        total -= sizes[key]
        left_out.append(key)
        parts.pop(key)
    kept = {
        "format": 1,
        "identity": identity(cfg),
        "dtype": cfg.output.keep_model,
        "model": model,
        "parts": parts,
        "left_out": left_out,
    }
    buffer = _bytes(kept)
    atomic_write(path, buffer)
    return {"dtype": cfg.output.keep_model, "mib": round(len(buffer) / 2**20, 3), "left_out": left_out}


def _bytes(tree) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return buffer.getvalue()


def load_model(path: Path, algorithm: Algorithm) -> dict:
    """A kept run's ``model.pt`` into ``algorithm`` (in its own float type): its identity returned,
    to be checked by the caller; one line if it cannot be read or does not fit."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)  # a crafted file must not run code
        ident, dtype = saved["identity"], saved["dtype"]
    except Exception as exc:  # noqa: BLE001 — whatever a cut-off, edited or foreign file raises
        raise FedmetaError(
            f"{path} cannot be read ({type(exc).__name__}): it is corrupt or not a fedmeta model"
        ) from None
    if dtype not in MODEL_DTYPES:
        raise FedmetaError(f"{path} holds a model of type {dtype!r}, none fedmeta writes")
    ours = algorithm.federation_state()
    reference = next(algorithm.model.parameters())

    def widen(saved_tree, like):  # each tensor back to the type and device the run's own has
        if isinstance(saved_tree, dict):
            return {
                k: widen(v, like.get(k) if isinstance(like, dict) else None) for k, v in saved_tree.items()
            }
        if isinstance(saved_tree, (list, tuple)):
            return type(saved_tree)(widen(v, None) for v in saved_tree)
        if isinstance(saved_tree, torch.Tensor):
            like = like if isinstance(like, torch.Tensor) else reference
            dtype = (
                like.dtype
                if saved_tree.is_floating_point() and like.is_floating_point()
                else saved_tree.dtype
            )
            return saved_tree.to(like.device, dtype)
        return saved_tree

    state = {"model": widen(saved["model"], ours["model"]), **widen(saved.get("parts", {}), ours)}
    try:
        algorithm.load_federation_state(state)
    except Exception as exc:  # noqa: BLE001
        left = f"; it left out {', '.join(saved.get('left_out') or [])}" if saved.get("left_out") else ""
        raise FedmetaError(
            f"{path} does not fit this run's model ({type(exc).__name__}{left}): it is from another run"
        ) from None
    return {"identity": ident, "dtype": dtype, "left_out": list(saved.get("left_out") or [])}


def load(fabric: Fabric, path: Path, algorithm: Algorithm, cfg: DictConfig) -> dict:
    """Restore ``algorithm`` and the generators from ``path``; returns the round and history."""
    try:
        state = fabric.load(path, weights_only=True)  # explicit: a crafted checkpoint must not run code
        saved_identity, round_ = state["identity"], int(state["round"])
    except Exception as exc:
        raise FedmetaError(
            f"{path} cannot be read ({type(exc).__name__}): it is corrupt or not a fedmeta checkpoint; "
            "start over with output.overwrite=true"
        ) from None
    check_identity(path, saved_identity, cfg)
    saved_precision = state.get("precision")  # absent in checkpoints written before it was recorded
    if (
        saved_precision is not None
        and saved_precision != str(cfg.fabric.precision)
        and not cfg.output.change_precision
    ):
        raise FedmetaError(
            f"{path} was trained in fabric.precision={saved_precision}, this run asks for "
            f"{cfg.fabric.precision}: resume in {saved_precision}, or allow it with output.change_precision=true"
        )
    if round_ > cfg.federation.rounds:
        raise FedmetaError(f"{path} is at round {round_}, beyond federation.rounds={cfg.federation.rounds}")
    try:
        algorithm.load_federation_state(state["federation"])
    except Exception as exc:
        raise FedmetaError(
            f"{path} does not fit this model ({type(exc).__name__}): start over with output.overwrite=true"
        ) from None
    _set_rng_states(state["rng"])
    return state


def check_identity(path: Path, saved: dict, cfg: DictConfig, ignore: tuple[str, ...] = ()) -> None:
    """The checkpoint at ``path`` was written by a run of ``cfg``'s experiment (``ignore``: keys that may differ)."""
    different = [d for d in identity_differences(saved, cfg) if not d.startswith(ignore)]
    if different:
        raise FedmetaError(
            f"{path} belongs to another experiment ({'; '.join(different[:3])}): use the "
            "settings it was written with, or start over with output.overwrite=true"
        )


def differences(saved, ours, prefix: str = "", added_ok: bool = False, defaults=...) -> list[str]:
    """Where the nested mapping ``saved`` differs from ``ours``, one "key: saved there, ours here"
    each. A key ``saved`` lacks was added to fedmeta after it was written: it is no difference where
    ours holds that key's default (configs/config.yaml's: what the run did before the key existed),
    or whatever ours holds with ``added_ok``."""
    if defaults is ...:
        defaults = base_defaults()
    if isinstance(saved, dict) and isinstance(ours, dict):
        defaults = defaults if isinstance(defaults, dict) else {}
        return [
            d
            for key in sorted(set(saved) | set(ours))
            for d in differences(
                saved[key] if key in saved else ...,
                ours.get(key),
                f"{prefix}{key}.",
                added_ok,
                defaults.get(key, ...),
            )
        ]
    if saved is ...:  # the key did not exist when ``saved`` was written
        if added_ok or (defaults is not ... and defaults == ours):
            return []
        saved = None
    if saved == ours:
        return []
    return [f"{prefix[:-1]}: {saved!r} there, {ours!r} here"]


@functools.cache
def base_defaults() -> dict:
    """The identity sections of configs/config.yaml as written (every data set and method file
    merges over them)."""
    from fedmeta.config import CONFIG_DIR

    base = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"), resolve=False)
    return {key: base[key] for key in IDENTITY if isinstance(base.get(key), dict)}


def _base_net(model: dict) -> dict:
    """The base network's parameters of a saved model: the model itself, CAFeMe's ``base.``, or
    IFCA's first model (``nets.0.``; the authors' IFCA holds one model under k names)."""
    for prefix in ("nets.0.", "base."):
        if any(key.startswith(prefix) for key in model):
            return {key[len(prefix) :]: value for key, value in model.items() if key.startswith(prefix)}
    return model


FINISHED_RUN = (
    "runs/<setting>/<method>/seed<k> (where fedmeta train left summary.json and checkpoint.ckpt; "
    "{seed} in the path stands for this run's seed)"
)


def _source_summary(path: Path) -> dict:
    """The summary.json of a warm start's source run, or one line saying why it is not one."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        why = type(exc).__name__
    else:
        if isinstance(summary, dict):
            return summary
        why = f"a JSON {type(summary).__name__}, not a mapping"
    raise FedmetaError(
        f"model.init_from: {path} is not a finished run's summary ({why}): run that run again, or give "
        f"another finished run's folder, {FINISHED_RUN}"
    )


def warm_start(algorithm: Algorithm, cfg: DictConfig) -> dict | None:
    """``model.init_from``: this run starts from another finished run's final global model — its base
    network placed in every IFCA model, or in CAFeMe's base (the modulator starts fresh); nothing of
    its clients' state. ``{seed}`` in the path is this run's seed. Returns what the summary records."""
    if not cfg.model.init_from:
        return None
    source = Path(str(cfg.model.init_from).replace("{seed}", str(cfg.seed)))
    path = source / "checkpoint.ckpt"
    missing = [name for name in ("summary.json", "checkpoint.ckpt") if not (source / name).is_file()]
    if missing:
        raise FedmetaError(
            f"model.init_from: {source} "
            + ("does not exist" if not source.is_dir() else f"holds no {' and no '.join(missing)}")
            + f", so it is not a finished run's folder: give one, {FINISHED_RUN}"
        )
    summary = _source_summary(source / "summary.json")
    import torch

    try:
        model = torch.load(path, map_location="cpu", weights_only=True)["federation"]["model"]
    except Exception as exc:  # noqa: BLE001 — whatever a corrupt file raises
        raise FedmetaError(
            f"model.init_from: {path} cannot be read ({type(exc).__name__}): it is corrupt or not a "
            "fedmeta checkpoint"
        ) from None
    base, target = _base_net(model), algorithm.model.state_dict()
    prefixes = sorted({key[: key.index(".", 5) + 1] for key in target if key.startswith("nets.")}) or (
        ["base."] if any(key.startswith("base.") for key in target) else [""]
    )
    for prefix in prefixes:
        ours = {key[len(prefix) :]: value for key, value in target.items() if key.startswith(prefix)}
        differs = [
            key
            for key in ours.keys() | base.keys()
            if key not in ours or key not in base or ours[key].shape != base[key].shape
        ]
        if differs:
            raise FedmetaError(
                f"model.init_from={source}: its model does not fit this one (first difference: "
                f"{sorted(differs)[0]}): start from a run of the same data set and model.* settings"
            )
        target.update({prefix + key: value.to(target[prefix + key].dtype) for key, value in base.items()})
    algorithm.model.load_state_dict(target)
    return {
        "run": str(source),
        "method": summary.get("method"),
        "variant": summary.get("variant"),
        "rounds": summary.get("rounds"),
        "accuracy": summary.get("accuracy"),
        "init_from": summary.get("init_from"),
    }
