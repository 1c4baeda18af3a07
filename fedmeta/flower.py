"""fedmeta on Flower: one ClientApp and one ServerApp that run any fedmeta ``Algorithm`` across
real processes (Flower's Deployment Engine: a SuperLink and SuperNodes over gRPC) or Flower's
Simulation Engine — without a second implementation of anything.

The ServerApp runs ``fedmeta.loop.train`` unchanged: the same sampling, aggregation, drop-out
rule, evaluation schedule, checkpoints and run folder. Only *where a client computes* changes:
``FlowerEngine`` takes the engine's place and sends each sampled client's work to the SuperNode
that holds the client, which runs the same ``Algorithm.run_client`` (training) or the shared
personalization procedure (evaluation) on its own data and replies. A client's kept state
(FedRep's head, the authors' Adam moments, SCAFFOLD's c_i) stays on its node, in the node's Flower
context; server state that a client reads besides the model (SCAFFOLD's c, FedProto's prototypes:
``Algorithm.broadcast_state``) travels with the model in each message.

Which clients a node holds comes from its node config: ``partition-id`` p of ``num-partitions``
P holds the clients whose id ≡ p (mod P) — one client per node with P = number of clients, or a
site of several clients. Every node builds the federation from its own copy of the data set and
keeps only its clients' data; the server builds it too, to know the client ids and the new
clients' count (it never trains on it).

Run configuration (``--run-config`` of ``flwr run``, or ``fedmeta flower``): ``overrides``, the
``fedmeta train`` overrides as one string; ``timeout``, the seconds a node may take per client
(a round waits that long times the most clients any one node has in it); ``dp-*``: local
differential privacy (``local_dp``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from omegaconf import OmegaConf, open_dict

from fedmeta.algorithms.base import ClientUpdate
from fedmeta.config import compose
from fedmeta.data.federation import Client
from fedmeta.errors import FedmetaError

log = logging.getLogger("fedmeta")
STATE = "fedmeta-client-states"  # the node context's record of its clients' kept state


def node_clients(context: Context) -> tuple[int, int]:
    """(partition id, number of partitions) of this node, from its node config."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except (KeyError, ValueError):
        raise FedmetaError(
            'a fedmeta SuperNode needs --node-config "partition-id=<p> num-partitions=<P>"'
        ) from None


@lru_cache(maxsize=2)
def _node(overrides: str):
    """The federation and algorithm a node computes with (built once per process and run config)."""
    from fedmeta.assemble import build, make_fabric

    cfg = compose(shlex.split(overrides) + ["logger=[]"])
    fabric = make_fabric(cfg)
    federation, algorithm = build(fabric, cfg)
    return cfg, federation, algorithm


def _client(msg: Message, context: Context, overrides: str | None) -> tuple:
    cfg, federation, algorithm = _node(
        overrides if overrides is not None else str(context.run_config["overrides"])
    )
    client_id = int(msg.content["config"]["client"])
    partition, partitions = node_clients(context)
    if client_id % partitions != partition:
        raise FedmetaError(f"client {client_id} is not held by partition {partition} of {partitions}")
    client = next(c for c in (*federation.train_clients, *federation.new_clients) if c.id == client_id)
    if msg.metadata.message_type == "evaluate" and client in federation.train_clients:
        client = client.scoring()  # a training client is scored on its own test split
    algorithm.model.load_state_dict(msg.content["model"].to_torch_state_dict())
    shared = msg.content["shared"].to_torch_state_dict() if "shared" in msg.content else {}
    algorithm.load_broadcast_state(
        {k: v.to(next(algorithm.model.parameters()).device) for k, v in shared.items()}, client_id
    )  # SCAFFOLD's server control variate, FedPAC's head for this client
    return cfg, algorithm, client


def _read_kept(context: Context, algorithm, client: Client) -> ConfigRecord:
    """The node's record of its clients' kept state, with ``client``'s (if any) made the
    algorithm's own."""
    kept = context.state.get(STATE, ConfigRecord())
    algorithm.client_states = (
        {client.id: torch.load(io.BytesIO(kept[str(client.id)]), weights_only=True)}
        if str(client.id) in kept
        else {}
    )
    return kept


def _to_bytes(tree) -> bytes:
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return buffer.getvalue()


def _replying(handler):
    """A client's failure (a non-finite personalization loss, a bug) as its reply's content, with the
    client's id and the reason in one line, as fedmeta reports a failed client in one process."""

    def handle(msg: Message, context: Context) -> Message:
        try:
            return Message(handler(msg, context), reply_to=msg)
        except Exception as exc:  # noqa: BLE001 — the server drops the client and says why
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            return Message(
                RecordDict(
                    {
                        "metrics": MetricRecord({"client": int(msg.content["config"]["client"])}),
                        "failure": ConfigRecord({"reason": reason}),
                    }
                ),
                reply_to=msg,
            )

    handle.__name__ = handler.__name__
    return handle


DP_KEYS = ("dp-clipping-norm", "dp-sensitivity", "dp-epsilon", "dp-delta")


def local_dp(settings: dict | None):
    """A ClientApp mod: Flower's ``LocalDpMod`` on training replies when differential privacy is
    asked for (``settings``, else the run config's ``dp-*`` keys): the client clips its update
    (new − global parameters) to an L2 norm and adds Gaussian noise before it leaves the node."""
    from flwr.clientapp.mod import LocalDpMod

    def mod(msg: Message, context: Context, call_next) -> Message:
        chosen = settings or {key: context.run_config[key] for key in DP_KEYS if key in context.run_config}
        if msg.metadata.message_type != "train" or not chosen:
            return call_next(msg, context)
        return LocalDpMod(*(float(chosen[key]) for key in DP_KEYS))(msg, context, call_next)

    return mod


def make_client_app(overrides: str | None = None, dp: dict | None = None) -> ClientApp:
    """The ClientApp; its run's fedmeta overrides come from ``overrides``, else the run config;
    local differential privacy from ``dp`` ({dp-clipping-norm, dp-sensitivity, dp-epsilon,
    dp-delta}), else the run config's dp-* keys, else none."""
    app = ClientApp(mods=[local_dp(dp)])

    @app.query()
    def which_clients(msg: Message, context: Context) -> Message:
        """Which partition this node holds: the server maps clients to nodes with it."""
        partition, partitions = node_clients(context)
        return Message(
            RecordDict({"node": MetricRecord({"partition-id": partition, "num-partitions": partitions})}),
            reply_to=msg,
        )

    @app.train()
    @_replying
    def train_client(msg: Message, context: Context) -> RecordDict:
        """One sampled client's local update, from the global model in the message."""
        _, algorithm, client = _client(msg, context, overrides)
        kept = _read_kept(context, algorithm, client)
        update = algorithm.run_client(client, int(msg.content["config"]["round"]))
        if update.state is not None:  # what the client keeps stays on its node
            kept[str(client.id)] = _to_bytes(update.state)
            context.state[STATE] = kept
        return RecordDict(
            {
                "update": ArrayRecord({k: v.contiguous() for k, v in update.params.items()}),
                "metrics": MetricRecord(
                    {"client": client.id, "weight": update.weight, "loss": float(update.loss)}
                ),
            }
        )

    @app.evaluate()
    @_replying
    def evaluate_client(msg: Message, context: Context) -> RecordDict:
        """One client's personalization curve (the shared test-time procedure): a new client's from
        the global model, a training client's on its own test split — from the model its method
        keeps for it (``kept``: the state that waits on this node) where it keeps one."""
        from fedmeta.evaluation import personalize_client

        cfg, algorithm, client = _client(msg, context, overrides)
        kept = bool(msg.content["config"]["kept"])
        if kept:
            _read_kept(context, algorithm, client)
        sent = msg.content["config"]  # the server's: steps 0 where a kept model is scored as it is
        personalization = OmegaConf.merge(
            cfg.personalization, {"steps": int(sent["steps"]), "lr": float(sent["lr"])}
        )
        with open_dict(personalization):
            personalization.every_step = bool(sent["every_step"])
        _, curve = personalize_client(algorithm, client, personalization, kept)
        return RecordDict({"metrics": MetricRecord({"client": client.id, "curve": curve.tolist()})})

    return app


def _waves(messages: list[Message]) -> list[list[Message]]:
    """The messages in waves that hold at most one for each node. A node keeps its clients' state in
    its Context, and Flower's Simulation Engine runs two messages for one node at once, each on a
    copy of that Context, keeping only the copy saved last: a client's kept state would be lost.
    A wave waits for its replies before the next is sent."""
    waves: list[list[Message]] = []
    for message in messages:
        node = message.metadata.dst_node_id
        free = next((w for w in waves if all(m.metadata.dst_node_id != node for m in w)), None)
        if free is None:
            waves.append(free := [])
        free.append(message)
    return waves


class FlowerEngine:
    """The engine of a run whose clients are Flower SuperNodes: same interface as fedmeta.engine.Engine."""

    def __init__(self, grid: Grid, node_of: dict[int, int], timeout: float):
        self.grid, self.node_of, self.timeout = grid, node_of, timeout
        self.bytes_sent = self.bytes_received = self.messages = 0  # tensors' bytes both ways, messages sent

    def describe(self) -> dict:
        return {"vectorized": False, "capture": "none", "recorded": False, "fallback": None}

    def label(self) -> str:
        return "clients on Flower SuperNodes"

    def _exchange(self, lanes: list, kind: str, round_: int, **config) -> dict[int, Message | str]:
        """Send each lane's client its message (``config``: more of its config record); its reply,
        or why there is none, by client id."""
        messages, model_bytes, gone = [], {}, {}
        connected = set(self.grid.get_node_ids())  # a node whose heartbeats stopped is no longer listed
        for algorithm, client in lanes:
            if self.node_of[client.id] not in connected:
                gone[client.id] = f"dropped out: its node {self.node_of[client.id]} left the federation"
                continue
            state = algorithm.model.state_dict()
            content = RecordDict(
                {
                    "model": ArrayRecord(state),
                    "config": ConfigRecord({"round": round_, "client": client.id, **config}),
                }
            )
            shared = algorithm.broadcast_state(client.id)
            if (
                shared
            ):  # the server's state a client reads besides the model (SCAFFOLD's c, FedProto's prototypes)
                content["shared"] = ArrayRecord({k: v.contiguous() for k, v in shared.items()})
            messages.append(Message(content, self.node_of[client.id], kind, group_id=str(round_)))
            model_bytes[client.id] = sum(
                t.numel() * t.element_size() for t in (*state.values(), *shared.values())
            )
        replies = {}
        for reply in (
            r for wave in _waves(messages) for r in self.grid.send_and_receive(wave, timeout=self.timeout)
        ):
            if reply.has_error():  # the ClientApp itself failed: counted as no reply
                log.warning(f"a node replied with an error: {reply.error.reason.strip().splitlines()[-1:]}")
            elif "failure" in reply.content:
                replies[int(reply.content["metrics"]["client"])] = (
                    f"failed on its node: {reply.content['failure']['reason']}"
                )
            else:
                replies[int(reply.content["metrics"]["client"])] = reply
        self.bytes_sent += sum(model_bytes.values())
        self.messages += len(messages)
        replies |= gone
        return {
            client.id: replies.get(
                client.id,
                f"dropped out: no reply from node {self.node_of[client.id]} within {self.timeout:g} s",
            )
            for _, client in lanes
        }

    def local_updates(self, lanes: list, round_: int) -> list[ClientUpdate | str]:
        results = []
        for (_, client), reply in zip(lanes, self._exchange(lanes, "train", round_).values()):
            if isinstance(reply, str):
                results.append(f"client {client.id} {reply}")
                continue
            params = reply.content["update"].to_torch_state_dict()
            self.bytes_received += sum(t.numel() * t.element_size() for t in params.values())
            metrics = reply.content["metrics"]
            results.append(ClientUpdate(client.id, params, float(metrics["weight"]), float(metrics["loss"])))
        return results

    def personalization_curves(
        self, lanes: list, cfg, done=lambda clients: None, kept: bool = False
    ) -> torch.Tensor:
        """Each client's curve, computed on the node that holds it (a training client on its test
        split; ``kept``: from the state its node keeps); a client whose node did not answer gets a row of NaN
        (left out). ``done(n)``: the engine's progress callback, called once all replies are in."""
        # the server's procedure: its steps, its step size (a candidate's, or the one lr_rule chose)
        replies = self._exchange(
            lanes,
            "evaluate",
            0,
            kept=kept,
            steps=int(cfg.steps),
            lr=float(cfg.lr),
            every_step=bool(cfg.get("every_step", True)),
        )
        done(len(lanes))
        which = "training" if kept else "new"
        missing = [f"client {cid} {r}" for cid, r in replies.items() if isinstance(r, str)]
        for line in missing:
            log.warning(f"evaluation: {line}; left out of the {which}-client accuracy")
        if len(missing) == len(lanes):
            raise FedmetaError(f"no {which} client answered the evaluation ({missing[0]})")
        return torch.stack(
            [
                torch.full((cfg.steps + 1 if cfg.get("every_step", True) else 1,), float("nan"))
                if isinstance(r, str)
                else torch.tensor(list(r.content["metrics"]["curve"]))
                for r in replies.values()
            ]
        )


def discover(grid: Grid, clients: list[Client], timeout: float) -> dict[int, int]:
    """Client id → the node holding it, asked of every node (waiting up to ``timeout`` for all
    partitions to be connected)."""
    deadline, partitions, node_of = time.monotonic() + timeout, None, {}
    while time.monotonic() < deadline:
        nodes = list(grid.get_node_ids())
        asked = [Message(RecordDict(), node, "query") for node in nodes if node not in node_of.values()]
        for reply in (
            grid.send_and_receive(asked, timeout=max(1.0, deadline - time.monotonic())) if asked else []
        ):
            if not reply.has_error():
                info = reply.content["node"]
                partitions = int(info["num-partitions"])
                for client in clients:
                    if client.id % partitions == int(info["partition-id"]):
                        node_of[client.id] = reply.metadata.src_node_id
        if partitions and len(node_of) == len(clients):
            return node_of
        time.sleep(1)
    held = sorted({c.id % partitions for c in clients if c.id not in node_of}) if partitions else "all"
    raise FedmetaError(
        f"after {timeout:g} s, no SuperNode holds partition(s) {held}: start them, or raise timeout"
    )


def make_server_app(overrides: str | None = None, timeout: float | None = None) -> ServerApp:
    """The ServerApp: ``fedmeta train`` with the clients on the SuperNodes. Its overrides and the
    seconds a round waits for replies come from the arguments, else the run config."""
    app = ServerApp()

    @app.main()
    def server(grid: Grid, context: Context) -> None:
        from fedmeta.assemble import build, make_fabric
        from fedmeta.loop import train

        cfg = compose(
            shlex.split(overrides if overrides is not None else str(context.run_config["overrides"]))
        )
        wait = timeout if timeout is not None else float(context.run_config.get("timeout", 120))
        federation, _ = build(make_fabric(cfg), cfg)
        engine = FlowerEngine(
            grid, discover(grid, [*federation.train_clients, *federation.new_clients], wait), wait
        )
        summary = train(cfg, show_progress=False, engine=engine)
        from fedmeta.config import run_name
        from fedmeta.runs import atomic_write_text

        traffic = {
            "model_bytes_sent": engine.bytes_sent,
            "update_bytes_received": engine.bytes_received,
            "messages": engine.messages,
            "seconds_per_round": summary["seconds_per_round"],
        }
        atomic_write_text(
            Path(cfg.output.root) / run_name(cfg) / "flower.json", json.dumps(traffic, indent=2)
        )

    return app


# for flwr run ([tool.flwr.app.components]): overrides and timeout from the run config
client_app = make_client_app()
server_app = make_server_app()


APP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedmeta-flower"
version = "0.1.0"
description = "fedmeta's ServerApp and ClientApp (fedmeta.flower)"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "fedmeta"

[tool.flwr.app.components]
serverapp = "fedmeta.flower:server_app"
clientapp = "fedmeta.flower:client_app"

[tool.flwr.app.config]
overrides = ""
timeout = 120
"""


class Deployment:
    """A SuperLink and ``nodes`` SuperNodes as processes on this machine (insecure: loopback
    only), and fedmeta runs submitted to them with ``flwr run``. ``commands()`` are what to start
    by hand — on several machines, with TLS (docs/scaling.md)."""

    def __init__(self, nodes: int, folder: Path, port: int = 9091):
        self.nodes, self.folder, self.port = nodes, folder, port
        self.processes: list[subprocess.Popen] = []
        self.home = folder / "flower-home"  # FLWR_HOME: the CLI's connection, the SuperLink's and nodes' apps
        self.app = folder / "flower-app"

    def commands(self) -> list[list[str]]:
        bin_dir = Path(sys.executable).parent
        link = [
            str(bin_dir / "flower-superlink"),
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        return [link] + [
            [
                str(bin_dir / "flower-supernode"),
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(self.port + 3 + i),
                "--node-config",
                f"partition-id={i} num-partitions={self.nodes}",
            ]
            for i in range(self.nodes)
        ]

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.app.mkdir(parents=True, exist_ok=True)
        (self.app / "pyproject.toml").write_text(APP_PYPROJECT)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "fedmeta"\n\n[superlink.fedmeta]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        env = self.environment()
        for i, command in enumerate(self.commands()):
            log_file = open(self.folder / (f"supernode{i - 1}.log" if i else "superlink.log"), "w")
            self.processes.append(
                subprocess.Popen(
                    command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )  # its own group: stopping it stops its children
            if i == 0:
                time.sleep(3)  # the SuperLink listens before the nodes connect

    def environment(self) -> dict[str, str]:
        """This environment's Flower executables first on the PATH (the SuperLink and SuperNodes
        start theirs by name), and the deployment's FLWR_HOME."""
        return os.environ | {
            "FLWR_HOME": str(self.home),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }

    @property
    def supernodes(self) -> list[subprocess.Popen]:
        return self.processes[1:]

    def submit(self, overrides: list[str], timeout: float, dp: dict | None = None) -> str:
        """Start a fedmeta run on the deployment; returns Flower's run id."""
        # a TOML string (Flower's run-config syntax) holding the overrides as one shell-quoted line
        config = (
            f"overrides={json.dumps(' '.join(shlex.quote(o) for o in overrides))} timeout={float(timeout)}"
        )
        config += "".join(f" {key}={float(value)}" for key, value in (dp or {}).items())
        flwr = Path(sys.executable).parent / "flwr"
        for _ in range(10):  # the SuperLink may still be starting
            done = subprocess.run(
                [str(flwr), "run", str(self.app), "fedmeta", "--run-config", config],
                capture_output=True,
                text=True,
                env=self.environment(),
            )
            started = re.search(r"started run (\d+)", done.stdout + done.stderr)
            if started:
                return started.group(1)
            time.sleep(2)
        said = " ".join(line.strip("│╭╮╰╯─ ") for line in (done.stdout + done.stderr).splitlines()).split()
        raise FedmetaError(f"flwr run was refused: {' '.join(said)[-300:]} (logs: {self.folder})")

    def kill(self, process: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill(process)

    def status(self, run_id: str) -> dict:
        """Flower's record of the run (``flwr ls``): its status and the SuperLink's traffic counters."""
        listed = subprocess.run(
            [
                str(Path(sys.executable).parent / "flwr"),
                "ls",
                "fedmeta",
                "--run-id",
                run_id,
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
            env=self.environment(),
        ).stdout
        with contextlib.suppress(json.JSONDecodeError, KeyError, IndexError):
            return json.loads(listed)["runs"][0]
        return {}

    def wait(self, run_id: str, summary: Path, limit: float) -> dict:
        """Until the run has finished with its summary written; returns Flower's record of it. A run
        that Flower reports finished without a summary, or that runs past ``limit`` seconds, is an
        error naming its log."""
        deadline = time.monotonic() + limit
        while True:
            record = self.status(run_id)
            if str(record.get("status", "")).startswith("finished"):
                if summary.exists():
                    return record
                raise FedmetaError(
                    f"Flower run {run_id} ended ({record['status']}) without a summary: see "
                    f"`FLWR_HOME={self.home} flwr log {run_id} fedmeta --show`"
                )
            if time.monotonic() > deadline:
                raise FedmetaError(
                    f"Flower run {run_id} took more than {limit:g} s; its processes are stopped"
                )
            time.sleep(2)


def simulate(overrides: list[str], nodes: int, timeout: float, dp: dict | None = None) -> None:
    """``fedmeta train``'s run with its clients on ``nodes`` simulated SuperNodes (Flower's
    Simulation Engine, Ray), one CPU each."""
    from flwr.simulation import run_simulation

    line = " ".join(shlex.quote(o) for o in overrides)
    run_simulation(
        make_server_app(line, timeout),
        make_client_app(line, dp),
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1}},
    )


def deploy(
    overrides: list[str],
    nodes: int,
    timeout: float,
    folder: Path,
    port: int,
    limit: float,
    dp: dict | None = None,
) -> Path:
    """The run on a SuperLink and ``nodes`` SuperNodes started here (loopback, insecure), stopped
    at the end; returns the run folder."""
    from fedmeta.config import run_name

    cfg = compose(overrides)
    run_dir = Path(cfg.output.root) / run_name(cfg)
    deployment = Deployment(nodes, folder, port)
    deployment.start()
    try:
        print(f"SuperLink on 127.0.0.1:{port}, {nodes} SuperNodes; logs in {folder}", file=sys.stderr)
        record = deployment.wait(deployment.submit(overrides, timeout, dp), run_dir / "summary.json", limit)
        traffic = json.loads((run_dir / "flower.json").read_text()) | {
            "superlink_network_traffic": record.get("network-traffic")
        }
        (run_dir / "flower.json").write_text(json.dumps(traffic, indent=2))
    finally:
        deployment.stop()
    return run_dir
