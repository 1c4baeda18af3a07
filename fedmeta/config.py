"""Configuration: YAML files in configs/ composed and overridden with OmegaConf.

``compose(["dataset=rmnist", "method=cafeme", "federation.rounds=100"])`` merges, in order:
configs/config.yaml, dataset/<d>.yaml, partition/<p>.yaml (default: the data set's), method/<m>.yaml
(after the file it ``inherits``), variant/<v>.yaml (for methods with variants), then every other
``key=value``. Keys that do not exist are refused, so a typo cannot pass silently.

Besides settings, a config file may say things about itself, which are read here and never merged
into a run's config: ``inherits`` (the file it extends), ``when`` (settings for one data set or
partition only), ``choices`` (the values a key of the file accepts, checked with every other value
once the config is composed) and, in a method's file, ``label`` (its name in tables) and ``tune``
(the search space of ``fedmeta tune``).
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedmeta.errors import FedmetaError

# configs/ of a checkout (an editable install), else the copy an installed package carries
_CHECKOUT_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CONFIG_DIR = (
    _CHECKOUT_CONFIGS
    if (_CHECKOUT_CONFIGS / "config.yaml").is_file()
    else Path(__file__).resolve().parent / "configs"
)


def user_config_dir() -> Path:
    """The user's own config files: $FEDMETA_CONFIG_HOME, else ~/.config/fedmeta. Read before
    CONFIG_DIR (a file of the same name there wins), checkout or installed package alike; fedmeta
    tune writes its tuned variants here."""
    return Path(os.environ.get("FEDMETA_CONFIG_HOME") or Path.home() / ".config" / "fedmeta").expanduser()


GROUPS = ("dataset", "partition", "method", "variant")
GROUP_WORDS = {
    "dataset": "data set",
    "partition": "partition",
    "method": "method",
    "variant": "variant",
    "preset": "preset",
}
# Fabric's precisions: "-true" ones convert the model (fabric.setup_module) and the inputs, the
# mixed ones enter autocast per forward pass (Algorithm.run_model).
PRECISIONS = ("32-true", "32", "64-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")


def _group_dirs(group: str, config_dir: Path) -> list[Path]:
    """Where a group's files are: the user's folder first (for the package's configs), then ``config_dir``."""
    user = user_config_dir()
    return ([user / group] if config_dir == CONFIG_DIR and user != CONFIG_DIR else []) + [config_dir / group]


_SKIPPED: dict[tuple, str] = {}  # a user's file that is not a config, and why: said once per version of it


def _readable(path: Path, config_dir: Path) -> bool:
    """Whether ``path`` can be read as a config file. The package's files are; a user's file that
    is not a regular file, not UTF-8 YAML or not a mapping is skipped with one notice, so that
    one broken file in the user's folder does not break every command (``--help`` included)."""
    if config_dir in path.parents:
        return True
    try:
        stat = path.stat()
    except OSError:  # a dangling link
        stat = None
    version = (path, stat and (stat.st_ino, stat.st_mode, stat.st_size, stat.st_mtime_ns))
    if version not in _SKIPPED:
        why = ""
        if not path.is_file():  # a folder, a pipe (which would block the read), a dangling link
            why = "not a regular file"
        elif stat.st_size > 1 << 20:
            why = "over 1 MiB"
        else:
            try:
                why = (
                    "" if isinstance(OmegaConf.load(path), DictConfig) else "not a mapping of keys to values"
                )
            except Exception as exc:  # YAML's parser errors, bytes that are not UTF-8
                why = f"does not parse as YAML ({type(exc).__name__})"
        _SKIPPED[version] = why
        if why:
            print(f"fedmeta: note: skipped {path}: {why}", file=sys.stderr)
    return not _SKIPPED[version]


def group_choices(group: str, config_dir: Path = CONFIG_DIR) -> list[str]:
    return sorted(
        {
            p.stem
            for folder in _group_dirs(group, config_dir)
            for p in folder.glob("*.yaml")
            if _readable(p, config_dir)
        }
    )


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # a file name of a config folder, or a setting: no path


def first_sentence(path: Path, width: int = 100) -> str:
    """The first sentence of a config file's leading comment: what the choice is."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines)
    end = re.search(
        r"\.\s+(?=[A-Z])", text
    )  # a full stop before a capital: not "et al. 2021" or "i.i.d. split"
    sentence = text[: end.start() + 1] if end else text
    return sentence if len(sentence) <= width else sentence[: width - 1].rstrip() + "…"


def catalog(config_dir: Path = CONFIG_DIR) -> str:
    """Every data set, partition, method and variant with one line each (``fedmeta train --help``)."""
    out = []
    for group in ("dataset", "partition", "method"):
        out.append(f"{group}=")
        for name in group_choices(group, config_dir):
            out.append(f"  {name:12s} {first_sentence(group_file(group, name, config_dir))}")
    out.append("variant=  (paper: the method file as is, the default)")
    for method in group_choices("method", config_dir):
        for name in group_choices(f"variant/{method}", config_dir):
            out.append(
                f"  {method + '/' + name:20s} {first_sentence(group_file('variant', f'{method}/{name}', config_dir))}"
            )
    return "\n".join(out)


def read_config_file(path: Path) -> DictConfig:
    """A config file as OmegaConf reads it, parsed once a process while it is unchanged: a command
    (a grid's plan, a study, the suite) composes the same dozen files many times."""
    stat = path.stat()
    return copy.deepcopy(_parsed(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=512)
def _parsed(path: Path, mtime_ns: int, size: int) -> DictConfig:
    return OmegaConf.load(path)


def load_mapping(path: Path, what: str) -> DictConfig:
    """A YAML file that must hold a mapping (a run's config.yaml, a bench config), or one line saying
    why it is not one."""
    if not path.is_file():
        raise FedmetaError(f"{path}: no such file (or not a regular file); give {what}")
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:  # YAML's parser errors, bytes that are not text
        raise FedmetaError(f"{path} does not parse as YAML ({type(exc).__name__}): give {what}") from None
    if not isinstance(cfg, DictConfig):
        raise FedmetaError(f"{path} is not a mapping of keys to values: give {what}")
    return cfg


def group_file(group: str, name: str, config_dir: Path = CONFIG_DIR) -> Path:
    """The file of choice ``name`` of ``group``: the package's, else (installed) the user's."""
    plain = isinstance(name, str) and all(
        NAME.fullmatch(part) and ".." not in part for part in name.split("/")
    )
    path = next(
        (
            folder / f"{name}.yaml"
            for folder in _group_dirs(group, config_dir)
            if plain and (folder / f"{name}.yaml").exists() and _readable(folder / f"{name}.yaml", config_dir)
        ),
        None,
    )
    if not plain or path is None:
        where = " and ".join(str(folder) for folder in _group_dirs(group, config_dir))
        raise FedmetaError(
            f"unknown {GROUP_WORDS[group]} {name!r}: choose one of {group_choices(group, config_dir)} "
            f"(the files in {where})"
        )
    return path


_NOTED: set[Path] = (
    set()
)  # files noted once a process: a user's that replaces a shipped one, an inherited steps: 0


def load_group(group: str, name: str, config_dir: Path, _seen: tuple[str, ...] = ()) -> DictConfig:
    """A choice's file merged over the file it ``inherits`` (a file of the user's may inherit a package's)."""
    path = group_file(group, name, config_dir)
    _require(name not in _seen, f"{path} inherits itself (through {' → '.join(_seen)}): break the loop")
    shipped = config_dir / group / f"{name}.yaml"
    if path != shipped and shipped.is_file() and path not in _NOTED:
        _NOTED.add(path)
        print(
            f"fedmeta: note: {GROUP_WORDS.get(group.split('/')[0], group)} {name} is your own {path}, "
            f"read in place of the one fedmeta ships ({shipped})",
            file=sys.stderr,
        )
    cfg = read_config_file(path)
    parent = cfg.pop("inherits", None)
    if not parent:
        return cfg
    try:
        return OmegaConf.merge(load_group(group, parent, config_dir, (*_seen, name)), cfg)
    except OmegaConfBaseException as exc:
        raise FedmetaError(f"{path} does not fit the file it inherits: {str(exc).splitlines()[0]}") from None


@dataclass(frozen=True)
class MethodCard:
    """What a method's file says about the method: its name in tables and its tuning space."""

    label: str  # "FedAvg-FT"
    tune: dict  # key → {log|float|int: [low, high]} or {choices: [...]}


def method_card(name: str, config_dir: Path = CONFIG_DIR) -> MethodCard:
    """``label`` and ``tune`` of configs/method/<name>.yaml (merged with the file it inherits)."""
    cfg = load_group("method", name, config_dir)
    tune = cfg.get("tune")
    return MethodCard(str(cfg.get("label") or name), OmegaConf.to_container(tune) if tune else {})


def _layers(choice: dict, base: DictConfig, config_dir: Path) -> tuple[list[DictConfig], str, dict]:
    """The chosen files in merge order, the variant, and the data set and partition picked."""
    dataset = load_group("dataset", choice["dataset"] or base.defaults.dataset, config_dir)
    partition = load_group("partition", choice["partition"] or dataset.pop("default_partition"), config_dir)
    dataset.pop("default_partition", None)
    method = load_group("method", choice["method"] or base.defaults.method, config_dir)
    layers = [base, dataset, partition, method]
    variant = choice["variant"] or base.defaults.variant
    if variant != "paper":  # the method file itself is the "paper" setting
        name = method.method.name
        available = ["paper", *group_choices(f"variant/{name}", config_dir)]
        if variant not in available:
            raise FedmetaError(f"method {name!r} has no variant {variant!r}: choose one of {available}")
        layers.append(load_group("variant", f"{name}/{variant}", config_dir))
    picked = {"dataset": dataset.dataset.name, "partition": partition.partition.name}
    return layers, variant, picked


def compose(overrides: list[str] = (), config_dir: Path = CONFIG_DIR) -> DictConfig:
    """The fully merged configuration for ``overrides`` (``key=value`` strings)."""
    return compose_with_choices(overrides, config_dir)[0]


def compose_with_choices(overrides: list[str] = (), config_dir: Path = CONFIG_DIR) -> tuple[DictConfig, dict]:
    """:func:`compose`, and the values its keys accept as its files declare them (``choices`` and
    ``ranges``): what later overrides of the same config are checked against."""
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0]]
    if bad:
        raise FedmetaError(f"overrides must be key=value, e.g. federation.rounds=5; got {bad[0]!r}")
    choice = dict.fromkeys(GROUPS)
    settings = []
    for override in overrides:
        key, value = override.split("=", 1)
        if key in GROUPS:
            _require(
                bool(value),
                f"{key}= needs a name: choose one of "
                f"{group_choices(key, config_dir) if key != 'variant' else 'paper, authors, …'}",
            )
            choice[key] = value
        else:
            settings.append(override)
    base = read_config_file(config_dir / "config.yaml")

    try:
        layers, variant, picked = _layers(choice, base, config_dir)
    except OmegaConfBaseException as exc:  # a file of the user's without a key every such file has
        raise FedmetaError(
            f"a chosen config file lacks {getattr(exc, 'full_key', None) or str(exc).splitlines()[0]!r}: "
            f"check your own files in {user_config_dir()}"
        ) from None
    method_name = choice["method"] or base.defaults.method
    chosen_steps = any(_sets_steps(layer) for layer in layers[4:])  # a variant's files set it
    for layer in list(
        layers
    ):  # ``when: {dataset=rmnist: {...}}``: settings for one data set or partition only
        for condition, conditional in (layer.pop("when", None) or {}).items():
            group, _, name = condition.partition("=")
            if group not in picked:
                raise FedmetaError(
                    f"a config's when: takes dataset=<name> or partition=<name>, got {condition!r}"
                )
            if picked[group] == name:
                layers.append(conditional)
    choices: dict[str, list] = {}
    for layer in layers:
        layer.pop("label", None)
        layer.pop("tune", None)
        choices |= OmegaConf.to_container(layer.pop("choices", None) or OmegaConf.create())
        choices |= OmegaConf.to_container(layer.pop("ranges", None) or OmegaConf.create())
    try:
        cfg = OmegaConf.merge(*layers)
    except OmegaConfBaseException as exc:  # a file of the user's whose values do not fit the keys they set
        raise FedmetaError(
            f"the chosen config files do not merge ({str(exc).splitlines()[0]}): check your own files "
            f"in {user_config_dir()}"
        ) from None
    _check_shape(cfg, base)
    cfg.variant = variant
    del cfg["defaults"]
    OmegaConf.set_struct(cfg, True)
    cfg = apply_overrides(cfg, settings, choices)
    if not chosen_steps and not any(s.split("=", 1)[0] == "personalization.steps" for s in settings):
        _note_inherited_scoring(method_name, cfg, config_dir)
    return cfg, choices


def _sets_steps(layer: DictConfig) -> bool:
    """Whether a config file sets personalization.steps itself (or in one of its ``when`` blocks)."""
    blocks = [layer, *(layer.get("when") or {}).values()]
    return any(OmegaConf.select(b, "personalization.steps", default=None) is not None for b in blocks)


def _note_inherited_scoring(name: str, cfg: DictConfig, config_dir: Path) -> None:
    """A one-line note when a method file that ``inherits`` another leaves personalization.steps to
    it and gets 0 — FedAvg's, IFCA's: the global model scored as it is, without fine-tuning — which
    a method added by copying FedAvg's file gets silently otherwise. Said once per file and process;
    setting the key in the file (0 included), in a variant or on the command line says it was meant."""
    if cfg.personalization.steps != 0:
        return
    path = group_file("method", name, config_dir)
    own = read_config_file(path)
    if not own.get("inherits") or _sets_steps(own) or path in _NOTED:
        return
    source = own
    while source.get("inherits") and not _sets_steps(source):
        parent = group_file("method", source.inherits, config_dir)
        source = read_config_file(parent)
    _NOTED.add(path)
    print(
        f"fedmeta: note: method {name} takes personalization.steps: 0 from {parent.name}, which it inherits: "
        f"its new clients are scored with the global model as it is, without fine-tuning; set "
        f"personalization.steps in {path} (0 to keep that, 50 to fine-tune as fedavg_ft) to say which",
        file=sys.stderr,
    )


def _check_shape(cfg: DictConfig, base: DictConfig) -> None:
    """The merged files have the sections every config has, as mappings: a file of the user's that
    sets a section to a value (``federation: 3``) or names no method is refused in one line."""
    sections = [key for key, value in base.items() if isinstance(value, DictConfig)]
    for key in ("dataset", "partition", "method", *sections):
        mapping = isinstance(cfg.get(key), DictConfig)
        _require(
            mapping and (key in sections or "name" in cfg[key]),
            f"the chosen config files leave {key} {'without a name' if mapping else 'no section'}: "
            f"check your own files in {user_config_dir()}",
        )
    _require(
        isinstance(cfg.method.get("algorithm"), str),
        f"the chosen method file names no method.algorithm: check your own files in {user_config_dir()}",
    )


def apply_overrides(
    cfg: DictConfig, settings: list[str], choices: dict[str, list] | None = None
) -> DictConfig:
    """``cfg`` (struct) with ``key=value`` settings merged in — each key must exist and each value
    have its key's type — resolved and range-checked; ``choices``: the values keys accept, as the
    composed files declared them."""
    for override in settings:
        key, value = override.split("=", 1)
        # OmegaConf would turn a value under the key into a group (federation.rounds.x=3 makes
        # federation.rounds a mapping), failing later in a check far from the cause
        parts = key.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            node = OmegaConf.select(cfg, parent, default=_ABSENT)
            if node is _ABSENT:
                break  # an unknown key: the merge below names it
            if not OmegaConf.is_dict(node):
                shown = (
                    f"[{','.join(map(str, node))}]"
                    if _is_list(node)
                    else NULLABLE.get(parent, "…")
                    if node is None
                    else node
                )
                raise FedmetaError(
                    f"{key}: {parent} is a value, not a group of keys: set {parent} itself, e.g. {parent}={shown}"
                )
        _require(
            "${" not in value,
            f"{key}: interpolations (${{…}}) are not taken on the command line; write the value "
            f"itself, e.g. {key}={OmegaConf.select(cfg, key, default='…')}",
        )
        if key in CHOSEN:
            raise FedmetaError(
                f"{key} is set by {CHOSEN[key]}=<name>, not on its own: choose another {CHOSEN[key]} "
                "(fedmeta train --help lists them)"
            )
    try:
        cli = OmegaConf.from_dotlist(list(settings))
    except Exception as exc:  # OmegaConf's own errors, and YAML's for values such as "["
        raise FedmetaError(f"cannot parse overrides {list(settings)}: {exc}".splitlines()[0]) from None
    for override in settings:
        key = override.split("=", 1)[0]
        default, value = OmegaConf.select(cfg, key, default=None), OmegaConf.select(cli, key, default=None)
        if _is_list(default) and isinstance(value, str) and all(isinstance(v, str) for v in default):
            value = [value]  # one name where a list of names is expected: logger=tensorboard
            OmegaConf.update(cli, key, value, merge=False)
        _check_type(key, default, value)
    try:
        cfg = OmegaConf.merge(cfg, cli)
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or str(exc).splitlines()[0]
        raise FedmetaError(
            f"unknown or invalid config key {key!r}: see configs/ for the keys that exist"
        ) from None
    validate(cfg, choices or {})
    steps = cfg.personalization.steps
    _require(
        steps <= MAX_PERSONALIZATION_STEPS,
        f"personalization.steps must be at most {MAX_PERSONALIZATION_STEPS}, got {steps}: each step's batch "
        "is drawn before the first step and each step's accuracy recorded (curves.csv, summary.json), so "
        "memory and files grow with the steps (the paper takes 50)",
    )
    return cfg


# 20 times the paper's 50: on a CPU about 20 minutes per evaluation of the 20 new clients, and a
# vectorized evaluation of CIFAR-10 holds 12 GB of drawn batches
MAX_PERSONALIZATION_STEPS = 1000
_ABSENT = object()  # OmegaConf.select's answer for a key that does not exist (None is a value)
CAPTURE_MODES = ("auto", "none", "static", "graph")  # federation.capture (fedmeta.capture)
# a client's batches: drawn afresh | a persistent iterator reshuffled every epoch | shuffled once
# (fedmeta.data.federation)
BATCHES = ("independent", "stream", "stream_fixed")

# keys where null means something, and an example of their other values (its type is theirs)
NULLABLE = {
    "personalization.held_out_batch_size": 30,
    "method.clusters": 4,
    "seeds": [0, 1, 2],
    "output.setting": "my-setting",
    "model.init_from": "runs/rmnist-shards/fedavg/seed{seed}",
}
OWN_CHECK = {"model.padding"}  # an integer or a word ("same"): validate() checks it
# keys that say which config file was chosen: changing one alone would mislabel the run (or name a folder)
CHOSEN = {"dataset.name": "dataset", "partition.name": "partition", "method.algorithm": "method"}


def _check_type(key: str, default, value) -> None:
    """A command-line value must have the type of the key's configured value: numbers for numbers
    (an int where an int is configured; finite), true/false for flags, lists for lists. Keys whose
    configured value is null or a string take any value (paths, names); keys where null means
    something (NULLABLE) may be set back to it."""
    if (value is None and key in NULLABLE) or key in OWN_CHECK:
        return
    if default is None:
        if key not in NULLABLE:
            return
        default = NULLABLE[key]
    _require(value is not None, f"{key} needs a value (got none): e.g. {key}={default}")
    if isinstance(default, str):
        _require(
            not _is_list(value) and not OmegaConf.is_dict(value) and not isinstance(value, dict),
            f"{key} must be a single value, e.g. {key}={default or 'name'}; got {value!r}",
        )
        return
    shown = f"{key} must be {{}}, got " + repr(value).replace("{", "{{").replace("}", "}}")
    if isinstance(default, bool):
        _require(isinstance(value, bool), shown.format("true or false"))
    elif isinstance(default, int):
        _require(isinstance(value, int) and not isinstance(value, bool), shown.format("an integer"))
    elif isinstance(default, float):
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            shown.format("a finite number"),
        )
    elif _is_list(default):
        example = f"[{','.join(map(str, default))}]" if len(default) else "[]"
        _require(_is_list(value), shown.format(f"a list, e.g. {key}={example}"))
    elif OmegaConf.is_dict(default):
        _require(OmegaConf.is_dict(value) or isinstance(value, dict), shown.format("a mapping"))


def _plain(name) -> bool:
    """A name that is one folder, never a path: it cannot climb out of output.root or name another folder."""
    return isinstance(name, str) and NAME.fullmatch(name) is not None and ".." not in name


def _is_list(value) -> bool:
    return OmegaConf.is_list(value) or isinstance(value, list)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise FedmetaError(message)


# A real value a method file's range admits is still refused beyond these magnitudes: 1e308 times
# any weight is inf in float32, and 5e-324 is 0 there.
FINITE_MAGNITUDE = (1e-8, 1e8)
INTERVAL = re.compile(r"([\[(])\s*(-inf|[-+0-9.e]+)\s*,\s*(inf|[-+0-9.e]+)\s*([\])])")


def _check_range(cfg: DictConfig, key: str, value, spec: dict) -> None:
    """A method file's ``ranges`` entry: ``{range: "[0, 1]", integer: true, means: "…"}`` or
    ``{equals: other.key, means: "…"}``; a value outside it is refused, saying what the key means."""
    means = spec.get("means", key)
    if "equals" in spec:
        other = OmegaConf.select(cfg, spec["equals"], default=None)
        _require(value == other, f"{key}={value!r}: {means} {spec['equals']} ({other})")
        return
    low_bracket, low, high, high_bracket = INTERVAL.fullmatch(spec["range"]).groups()
    integer = bool(spec.get("integer"))
    number = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    ok = number and (isinstance(value, int) or not integer)
    if ok:
        low_value, high_value = float(low), float(high)
        ok = (value > low_value or (low_bracket == "[" and value == low_value)) and (
            value < high_value or (high_bracket == "]" and value == high_value)
        )
    _require(ok, f"{key}={value!r}: {means} takes {'integers' if integer else 'values'} in {spec['range']}")
    _require(
        integer or value == 0 or FINITE_MAGNITUDE[0] <= abs(value) <= FINITE_MAGNITUDE[1],
        f"{key}={value!r}: {means} takes values in {spec['range']} of magnitude "
        f"{FINITE_MAGNITUDE[0]:g} to {FINITE_MAGNITUDE[1]:g} (or 0 where the range holds it): beyond, "
        "float32 training overflows or underflows",
    )


def validate(cfg: DictConfig, choices: dict[str, list]) -> None:
    """Range checks that the YAML types cannot express, and the ``choices`` the config files
    declare for their own keys; each failure is one line. Section by section, in this order."""
    _validate_choices(cfg, choices)
    _validate_federation(cfg)
    _validate_personalization(cfg.personalization)
    _validate_partition_and_method(cfg)
    _validate_model(cfg.model)
    _validate_output(cfg)
    _validate_fabric_and_loggers(cfg)


def _validate_choices(cfg: DictConfig, choices: dict[str, list]) -> None:
    for key, allowed in choices.items():
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(allowed, dict):
            _check_range(cfg, key, value, allowed)
            continue
        _require(
            value in allowed,
            f"{key} must be one of {', '.join(map(str, allowed))}, got {value!r}",
        )
    if cfg.method.get("hessian") == "exact" and cfg.method.get("first_order"):
        raise FedmetaError(
            "method.hessian=exact with method.first_order=true: the exact Hessian-vector product is the "
            "second-order term that first_order leaves out; choose one"
        )


def _validate_federation(cfg: DictConfig) -> None:
    fed = cfg.federation
    _require(fed.num_clients >= 2, f"federation.num_clients must be ≥ 2, got {fed.num_clients}")
    protocols = ("new_clients", "training_clients", "both")
    protocol = cfg.evaluation.protocol
    _require(
        protocol in protocols, f"evaluation.protocol must be one of {', '.join(protocols)}, got {protocol!r}"
    )
    least = (
        0 if protocol == "training_clients" else 1
    )  # the new clients are scored unless only training ones are
    _require(
        least <= fed.num_new_clients < fed.num_clients,
        f"federation.num_new_clients must be between {least} and num_clients-1, got {fed.num_new_clients}"
        + ("" if least == 0 else " (0 only with evaluation.protocol=training_clients)"),
    )
    train_clients = fed.num_clients - fed.num_new_clients
    _require(
        1 <= fed.clients_per_round <= train_clients,
        f"federation.clients_per_round must be between 1 and the {train_clients} training clients, got "
        f"{fed.clients_per_round}",
    )
    _require(
        fed.rounds >= 1 or (fed.rounds == 0 and cfg.model.init_from),
        f"federation.rounds must be ≥ 1 (0 only with model.init_from: the starting model evaluated), got {fed.rounds}",
    )
    _require(fed.eval_every >= 1, f"federation.eval_every must be ≥ 1, got {fed.eval_every}")
    _require(0 <= cfg.seed < 2**32, f"seed must be in [0, 2^32) (NumPy's seeds), got {cfg.seed}")
    if cfg.seeds is not None:
        seeds = list(cfg.seeds) if OmegaConf.is_list(cfg.seeds) else None
        _require(
            bool(seeds)
            and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32 for s in seeds)
            and len(set(seeds)) == len(seeds),
            f"seeds must be a list of distinct integers in [0, 2^32), e.g. seeds=[0,1,2], got {cfg.seeds}",
        )
    _require(
        isinstance(fed.vectorize, bool) or fed.vectorize == "auto",
        f"federation.vectorize must be true, false or auto, got {fed.vectorize!r}",
    )
    _require(
        fed.capture in CAPTURE_MODES,
        f"federation.capture must be one of {', '.join(CAPTURE_MODES)}, got {fed.capture!r}",
    )
    _require(
        fed.vectorize_lanes >= 0,
        f"federation.vectorize_lanes must be ≥ 0 (0: all clients at once), got {fed.vectorize_lanes}",
    )
    _require(
        _whole(fed.lane_buckets) and fed.lane_buckets >= 1,
        f"federation.lane_buckets must be an integer ≥ 1 (1: one vmapped call), got {fed.lane_buckets!r}",
    )
    _require(fed.client_threads >= 1, f"federation.client_threads must be ≥ 1, got {fed.client_threads}")
    _require(
        0 <= fed.client_failure_rate < 1,
        f"federation.client_failure_rate must be in [0, 1), got {fed.client_failure_rate}",
    )
    _require(
        fed.checkpoint_every >= 0,
        f"federation.checkpoint_every must be ≥ 0 (0: only at the end), got {fed.checkpoint_every}",
    )
    _require(
        fed.checkpoint_minutes >= 0,
        f"federation.checkpoint_minutes must be ≥ 0 (0: by rounds only), got {fed.checkpoint_minutes}",
    )
    _require(
        0 < fed.held_out_fraction < 1,
        f"federation.held_out_fraction must be in (0, 1), got {fed.held_out_fraction}",
    )


LR_RULES = ("method", "selected")


def _whole(value) -> bool:
    """An integer, not a bool (YAML's true is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_personalization(pers: DictConfig) -> None:
    _require(
        pers.steps >= 0 and pers.lr > 0 and pers.batch_size >= 2,
        "personalization needs steps ≥ 0, lr > 0 and batch_size ≥ 2 (BatchNorm's batch statistics need 2 samples)",
    )
    _require(
        isinstance(pers.decay_every, int) and pers.decay_every >= 1,
        f"personalization.decay_every must be an integer ≥ 1 (steps between decays), got {pers.decay_every!r}",
    )
    _require(
        pers.batches in BATCHES,
        f"personalization.batches must be one of {', '.join(BATCHES)}, got {pers.batches!r}",
    )
    _require(
        pers.held_out_batch_size is None or pers.held_out_batch_size >= 2,
        f"personalization.held_out_batch_size must be null (one pass) or ≥ 2, got {pers.held_out_batch_size}",
    )
    _require(
        pers.lr_rule in LR_RULES,
        f"personalization.lr_rule must be one of {', '.join(LR_RULES)}, got {pers.lr_rule!r}",
    )
    grid = list(pers.lr_grid) if OmegaConf.is_list(pers.lr_grid) else None
    _require(
        grid is not None
        and 1 <= len(grid) <= 16
        and all(isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr <= 10 for lr in grid)
        and len(set(grid)) == len(grid),
        f"personalization.lr_grid must list 1 to 16 distinct step sizes in (0, 10], got {pers.lr_grid}",
    )
    _require(
        _whole(pers.select_clients) and pers.select_clients >= 1,
        f"personalization.select_clients must be an integer ≥ 1 (validation clients), got {pers.select_clients!r}",
    )


def _validate_partition_and_method(cfg: DictConfig) -> None:
    train_clients = cfg.federation.num_clients - cfg.federation.num_new_clients
    if cfg.partition.name == "shards":
        _require(
            cfg.partition.shards_per_client >= 1,
            f"partition.shards_per_client must be ≥ 1, got {cfg.partition.shards_per_client}",
        )
    if cfg.partition.name == "dirichlet":
        _require(cfg.partition.alpha > 0, f"partition.alpha must be > 0, got {cfg.partition.alpha}")
    for key in ("inner_lr", "outer_lr", "local_lr"):
        if key in cfg.method:
            _require(cfg.method[key] > 0, f"method.{key} must be > 0, got {cfg.method[key]}")
    method = cfg.method
    for key, allowed in (
        ("train_split", ("all", "pers")),
        ("averaging", ("samples", "uniform")),
        ("local_optimizer", ("sgd", "adam_kept")),
        ("batches", BATCHES),
    ):
        if key in method:
            _require(
                method[key] in allowed,
                f"method.{key} must be one of {', '.join(allowed)}, got {method[key]!r}",
            )
    for key in ("batch_size", "eval_batch_size"):
        if key in method:
            _require(
                isinstance(method[key], int) and method[key] >= 2,
                f"method.{key} must be an integer ≥ 2 (BatchNorm's batch statistics need 2 samples), got {method[key]}",
            )
    if "inner_steps" in method:
        _require(method.inner_steps >= 1, f"method.inner_steps must be ≥ 1, got {method.inner_steps}")
    for key in ("local_batches", "personal_batches", "head_batches", "body_batches", "test_head_steps"):
        if key in method:
            _require(
                isinstance(method[key], int) and method[key] >= 0,
                f"method.{key} must be an integer ≥ 0, got {method[key]}",
            )
    if "clusters" in method:
        _require(
            method.clusters is None
            and cfg.dataset.name == "meta_dataset"
            or isinstance(method.clusters, int)
            and 1 <= method.clusters <= train_clients,
            f"method.clusters must be an integer from 1 to the {train_clients} training clients (null: "
            f"one per source, only for dataset=meta_dataset), got {method.clusters}",
        )


def _validate_model(model: DictConfig) -> None:
    """A text model (``kind: lstm``) has no conv stack: its own widths are checked instead."""
    text = model.kind == "lstm"
    widths = ("lstm_units",) if text else ("conv_channels", "dense_units")
    layers = {f"model.{k}": model[k] for k in widths}
    layers |= {f"model.modulator.{k}": v for k, v in model.modulator.items()}
    if text:
        layers["model.embedding_dim"] = [model.embedding_dim]
    for key, units in layers.items():
        _require(
            all(isinstance(u, int) and not isinstance(u, bool) and u >= 1 for u in units),
            f"{key} must list integers ≥ 1 (units per layer), e.g. {key}=[64,64]; got {list(units)}",
        )
    if text:
        return
    _require(model.kernel_size >= 1, f"model.kernel_size must be ≥ 1, got {model.kernel_size}")
    padding = model.padding
    _require(
        isinstance(padding, int)
        and not isinstance(padding, bool)
        and padding >= 0
        or padding in ("same", "valid"),
        f"model.padding must be an integer ≥ 0, same or valid, got {padding!r}",
    )


def _validate_output(cfg: DictConfig) -> None:
    _require(
        cfg.output.keep_model in ("float32", "float16", "bfloat16", "none"),
        f"output.keep_model must be float16, bfloat16, float32 or none, got {cfg.output.keep_model!r}",
    )
    mib = cfg.output.keep_model_mib
    _require(
        isinstance(mib, (int, float)) and not isinstance(mib, bool) and 0 < mib <= 1024,
        f"output.keep_model_mib must be a size in MiB in (0, 1024], got {mib!r}",
    )
    stop_at = cfg.output.get("stop_at")
    _require(
        stop_at is None
        or isinstance(stop_at, (int, float))
        and not isinstance(stop_at, bool)
        and stop_at > 0,
        f"output.stop_at must be null or a Unix time in seconds (e.g. $(( $(date +%s) + 600 ))), got {stop_at!r}",
    )
    turns = cfg.output.get("turns")
    _require(
        turns is None or isinstance(turns, str) and any(Path(turns).glob("turn-*")),
        f"output.turns must be null or a folder holding turn-* files (fedmeta campaign makes it), got {turns!r}",
    )
    setting = cfg.output.setting
    _require(
        setting is None or _plain(setting),
        f"output.setting must be a plain folder name (letters, digits, _ . -; no / or ..), got {setting!r}",
    )
    for key, value in (
        ("method.name", cfg.method.name),
        ("variant", cfg.variant),
    ):  # they name the run folder
        _require(
            _plain(value),
            f"{key} must be a plain name (letters, digits, _ . -; no / or ..), e.g. "
            f"method.name=cafeme; got {value!r}",
        )


def _validate_fabric_and_loggers(cfg: DictConfig) -> None:
    _require(
        str(cfg.fabric.precision) in PRECISIONS,
        f"fabric.precision must be one of {', '.join(PRECISIONS)}, got {cfg.fabric.precision!r}",
    )
    _require(cfg.fabric.num_nodes >= 1, f"fabric.num_nodes must be ≥ 1, got {cfg.fabric.num_nodes}")
    _require(
        cfg.fabric.devices == -1 or cfg.fabric.devices >= 1,
        f"fabric.devices must be ≥ 1 (or -1: every device of the machine), got {cfg.fabric.devices}",
    )
    _require(
        cfg.fabric.matmul_precision in ("highest", "high", "medium"),
        f"fabric.matmul_precision must be highest, high or medium, got {cfg.fabric.matmul_precision!r}",
    )
    loggers = list(cfg.logger) if OmegaConf.is_list(cfg.logger) else None
    _require(
        loggers is not None and set(loggers) <= {"csv", "tensorboard", "wandb"},
        "logger must be a list of csv, tensorboard, wandb (several at once, or []), e.g. "
        f"logger=[tensorboard,wandb]; got {cfg.logger}",
    )
    _require(
        cfg.wandb.mode in ("offline", "online", "disabled"),
        f"wandb.mode must be offline, online or disabled, got {cfg.wandb.mode!r}",
    )


def method_label(cfg: DictConfig) -> str:
    """<method>[-<variant>]: a run's method as its folder, its W&B job type and a table row name it
    ("fedrep", "fedrep-authors"; the paper variant is the method itself)."""
    return cfg.method.name if cfg.variant == "paper" else f"{cfg.method.name}-{cfg.variant}"


def run_name(cfg: DictConfig) -> Path:
    """runs/<setting>/<method>[-<variant>]/seed<seed>/ — fixed so scripts can rely on it."""
    return Path(setting_name(cfg)) / method_label(cfg) / f"seed{cfg.seed}"


def setting_name(cfg: DictConfig) -> str:
    """The experimental setting a run belongs to: ``output.setting``, else <dataset>-<partition>."""
    return cfg.output.setting or f"{cfg.dataset.name}-{cfg.partition.name}"
