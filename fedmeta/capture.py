"""A vectorized round (or evaluation) recorded once and replayed with new inputs
(``federation.capture``).

A round's vmapped computation launches thousands of tiny kernels, each with its Python, dispatch
and launch cost on the host; on a GPU that host work, not the arithmetic, sets the round's time.
Once the lanes' inputs have a fixed layout (fedmeta.engine pads them to one), the whole
computation can be recorded and replayed:

- ``graph``: a CUDA graph (``torch.cuda.graph``). The inputs are copied into static tensors the
  graph was recorded on, the graph is replayed — one launch — and its outputs are copied out
  (the next replay overwrites them).
- ``static`` (and ``none``): the function itself, eagerly — what the recording replays, runnable and
  testable on any device.

(``torch.compile`` was tried and removed: Dynamo broke the graph at torch.func's context variables and
thread checks and compiled only the data gather, while the run reported itself recorded.)

A computation that cannot be recorded (an operation that needs the host mid-computation, a
precision whose autocast cache cannot be captured) runs eagerly from then on, with one notice.
Each layout (lanes, batch sizes, steps) is recorded once; a run sees one or two per computation.
All recordings of a run share one memory pool — safe because they replay one at a time on one
stream and each replay's outputs are copied out at once — and a computation keeps only its
``LAYOUTS_KEPT`` latest layouts: a superseded one (fewer lanes after running out of memory, say)
is released with its graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fedmeta.config import CAPTURE_MODES

log = logging.getLogger("fedmeta")

WARMUP_CALLS = 2  # before a CUDA graph is recorded: lazy initialization and allocator warm-up off the graph
LAYOUTS_KEPT = 2  # recordings kept per computation (a round, an evaluation); an older layout is released


def resolve(
    vectorize: bool | str, capture: str, device: torch.device, vmap_faster: bool | None = None
) -> tuple[bool, str]:
    """``federation.vectorize`` and ``federation.capture`` on ``device``. ``auto``: vmapped clients
    recorded as CUDA graphs on a CUDA device; on the CPU the way ``make bench`` measured faster for
    the run on this CPU (``vmap_faster``: fedmeta.fastest), else one client at a time, where a
    round is bound by arithmetic and memory rather than by launches."""
    on_gpu = device.type == "cuda"
    vectorize = (on_gpu or bool(vmap_faster)) if vectorize == "auto" else bool(vectorize)
    if capture == "auto":
        capture = "graph" if vectorize and on_gpu else "none"
    return vectorize, capture


def _copy(tree) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _signature(inputs) -> tuple:
    leaves, spec = tree_flatten(inputs)
    return repr(spec), tuple(
        (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in leaves
    )


class _Graph:
    """One CUDA graph of ``fn`` over static copies of its inputs."""

    def __init__(self, fn: Callable, inputs: tuple, pool):
        self.fn = fn  # and so every tensor it reads (the device data): the graph reads them by address
        self.static = _copy(inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                fn(*self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.static)

    def __call__(self, inputs: tuple):
        for static, new in zip(tree_flatten(self.static)[0], tree_flatten(inputs)[0]):
            if isinstance(static, torch.Tensor) and static.data_ptr() != new.data_ptr():
                static.copy_(new, non_blocking=True)
        self.graph.replay()
        return _copy(self.outputs)


class Capture:
    """Runs a computation keyed by what it is (``key``) and by its inputs' layout: recorded on the
    first call of each, replayed after."""

    def __init__(self, mode: str = "none"):
        if mode not in CAPTURE_MODES[1:]:
            raise ValueError(
                f"capture mode must be one of {CAPTURE_MODES[1:]} (auto is resolved first), got {mode!r}"
            )
        self.mode = mode
        self.recordings: dict[tuple, dict[tuple, _Graph]] = {}  # per computation, per layout: oldest first
        self.pool = None  # the memory pool every recording of this run shares
        self.failed: str | None = None  # why the computation runs eagerly after all
        self.replayed = self.eager = 0  # calls of each kind, for summary.json

    @property
    def pads(self) -> bool:
        """Whether the inputs are padded to a fixed layout (every mode but ``none``)."""
        return self.mode != "none"

    @property
    def records(self) -> bool:
        return self.mode == "graph" and self.failed is None

    def run(self, key: tuple, fn: Callable, inputs: tuple):
        if not self.records:
            self.eager += 1
            return fn(*inputs)
        layouts = self.recordings.setdefault(key, {})
        signature = _signature(inputs)
        recording = layouts.get(signature)
        if recording is None:
            if len(layouts) >= LAYOUTS_KEPT:
                del layouts[next(iter(layouts))]  # the oldest layout: its graph and its memory go
            try:
                self.pool = self.pool or torch.cuda.graph_pool_handle()
                recording = _Graph(fn, inputs, self.pool)
            except torch.OutOfMemoryError:  # the engine halves the lanes per call and records those
                raise
            except Exception as exc:  # noqa: BLE001 — anything the recorder refuses: eager from now on, said once
                reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                self.failed = f"{type(exc).__name__}: {reason}"
                log.warning(
                    f"federation.capture={self.mode}: the computation could not be recorded ({self.failed}); "
                    "it runs eagerly (vmapped) instead"
                )
                self.eager += 1
                return fn(*inputs)
            layouts[signature] = recording
        self.replayed += 1
        return recording(inputs)
