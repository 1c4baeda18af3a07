"""Reads an offline W&B run file (``run-<id>.wandb``) back without a server: the file is W&B's
7-byte header, then a LevelDB-format log (32 KiB blocks of checksummed fragments) of
``wandb_internal_pb2.Record`` protobuf messages."""

from __future__ import annotations

import json
import struct
import time
from collections import defaultdict
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7  # crc32c (4) · length (2) · fragment type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    """Every Record of the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    offset, pending = 7, b""
    while offset + HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < HEADER:  # a block's tail too short for a header is padding
            offset += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + HEADER])
        if kind == 0 and length == 0:  # zero padding
            offset += left_in_block
            continue
        fragment = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        pending = fragment if kind in (FULL, FIRST) else pending + fragment
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_run(path: Path) -> dict:
    """The run's settings (name, group, job type, tags, config), history rows, summary, artifacts
    and the system metrics it sampled."""
    out = {"history": [], "summary": {}, "artifacts": [], "stats": defaultdict(list), "config": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(
                name=run.display_name,
                group=run.run_group,
                job_type=run.job_type,
                tags=list(run.tags),
                id=run.run_id,
            )
            out["config"] |= {item.key: json.loads(item.value_json) for item in run.config.update}
        elif kind == "history":
            out["history"].append(
                {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif kind == "summary":
            out["summary"] |= {
                "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                for item in record.summary.update
            }
        elif kind == "artifact":
            out["artifacts"].append(
                {
                    "type": record.artifact.type,
                    "name": record.artifact.name,
                    "files": [entry.path for entry in record.artifact.manifest.contents],
                }
            )
        elif kind == "stats":
            for item in record.stats.item:
                out["stats"][item.key].append(json.loads(item.value_json))
    return out


def read_written_run(folder: Path, wait: float = 60) -> dict:
    """:func:`read_run` of the run file in ``folder`` once it holds the run's own record: W&B's
    service may still be writing the file out when ``finish()`` returns (seconds on a busy machine)."""
    deadline = time.monotonic() + wait
    while True:
        logged = read_run(next(folder.glob("run-*.wandb")))
        if "name" in logged or time.monotonic() > deadline:
            return logged
        time.sleep(1)
