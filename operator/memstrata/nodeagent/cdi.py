"""Container Device Interface specs: how a prepared claim's devices reach its containers.

The DRA driver writes one spec file per prepared claim into the runtime's CDI directory; the kubelet
passes the devices' CDI names to the runtime (CRI `CDIDevices`), and the runtime (containerd >= 2.0, or
1.7 with enable_cdi) applies their edits to the container. One spec per claim: each of its devices adds its own /dev
node and the claim's environment (MEMSTRATA_NVME_DEVICES: every namespace of the claim), so a container
gets the whole claim's list whichever of its devices it names.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memstrata.api import dra
from memstrata.nodeagent.draslice import DraDevice, claim_env

CDI_VERSION = "0.6.0"
CDI_KIND = f"{dra.DRIVER}/claim"
CDI_DIR = Path("/var/run/cdi")
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


def _device_name(claim_uid: str, device: str) -> str:
    name = f"{claim_uid}-{device}"
    if not _NAME_OK.match(name):
        raise ValueError(f"claim {claim_uid!r}, device {device!r}: not a CDI device name")
    return name


def device_id(claim_uid: str, device: str) -> str:
    """The fully qualified CDI name of one claimed device: dra.memstrata.dev/claim=<uid>-<device>."""
    return f"{CDI_KIND}={_device_name(claim_uid, device)}"


def spec(claim_uid: str, chosen: Sequence[DraDevice], device_gid: int | None = None) -> dict[str, Any]:
    """The CDI spec of one claim: a CDI device per claimed device, each with its own /dev node and the
    claim's environment (the same values in each, so a container naming any of them gets all of it).

    `device_gid`: the training pods' device group (the operator's --training-device-gid), which owns each node
    in the container, mode 0660, as the device plugin's path has it; None: the runtime's defaults."""
    chosen = list({d.name: d for d in chosen}.values())  # a shared CXL device may serve two requests of a claim
    env = claim_env(chosen)
    devices = []
    for d in chosen:
        edits: dict[str, Any] = {"env": env}
        if d.dev_path:
            node: dict[str, Any] = {"path": d.dev_path, "permissions": "rw"}
            if device_gid is not None:
                node.update(gid=device_gid, fileMode=0o660)
            edits["deviceNodes"] = [node]
        devices.append({"name": _device_name(claim_uid, d.name), "containerEdits": edits})
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    # The runtime reads every *.json of the directory; the name says whose it is.
    return cdi_dir / f"{dra.DRIVER}-claim_{claim_uid}.json"


def write_spec(cdi_dir: Path, claim_uid: str, chosen: Sequence[DraDevice], device_gid: int | None = None) -> Path:
    """Write (atomically: the runtime may read the directory at any moment) the spec of one claim."""
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = spec_path(cdi_dir, claim_uid)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(spec(claim_uid, chosen, device_gid), indent=1))
    os.replace(tmp, path)
    return path


def remove_spec(cdi_dir: Path, claim_uid: str) -> bool:
    """Remove one claim's spec; False when there was none (unprepare may be repeated)."""
    try:
        spec_path(cdi_dir, claim_uid).unlink()
    except FileNotFoundError:
        return False
    return True


def _written(cdi_dir: Path, claim_uid: str) -> dict[str, Any]:
    """One claim's spec as on disk; {} when none is (never prepared here, or unprepared)."""
    try:
        return json.loads(spec_path(cdi_dir, claim_uid).read_text())
    except (OSError, ValueError):
        return {}


def prepared_devices(cdi_dir: Path, claim_uid: str) -> list[str]:
    """The devices of one claim whose spec is on disk (prepared, not yet unprepared); [] when none is."""
    prefix = f"{claim_uid}-"
    return [d["name"][len(prefix):] for d in _written(cdi_dir, claim_uid).get("devices", [])
            if d.get("name", "").startswith(prefix)]


def prepared_namespaces(cdi_dir: Path, claim_uid: str) -> list[str]:
    """The block devices (nvme0n1, loop3) one prepared claim's spec gives its containers; [] when none is on disk."""
    nodes = [n for d in _written(cdi_dir, claim_uid).get("devices", [])
             for n in d.get("containerEdits", {}).get("deviceNodes", [])]
    return sorted({Path(n["path"]).name for n in nodes if str(n.get("path", "")).startswith("/dev/")})
