"""The native engine on a real kernel: inside the QEMU guest, the raw-NVMe engine round-trips
data on the free namespace and refuses the three that hold data, and a NUMA arena bound to the
CPU-less CXL node (and the activation-checkpoint pool) really has its pages there (move_pages). Run with `make test-guest`.

Namespaces are found by nsid (device names follow probe order): 1 free, 2 ext4,
3 GPT-partitioned, 4 held by device-mapper (see guest-init.sh).
"""
from __future__ import annotations

import pytest

from guest import json_from_guest, missing_reason

pytestmark = [pytest.mark.guest, pytest.mark.slow]

SCRIPT = r'''
import glob, json, os, sys
from memstrata.runtime.strata import nvme, numa
from memstrata.node.safety import DeviceUnsafeError

out = {"refused": {}, "roundtrip": None}
by_nsid = {}
for d in glob.glob("/sys/block/nvme*n*"):
    name = os.path.basename(d)
    if "c" in name[len("nvme"):]:          # nvme0c0n1: hidden per-path node
        continue
    by_nsid[int(open(d + "/nsid").read())] = "/dev/" + name

payload = os.urandom((3 << 20) + 7)        # not a multiple of the block size
with nvme.NvmeEngine.open([by_nsid[1]], job="guest-e2e") as eng:
    ext = eng.allocate(len(payload))
    eng.wait(eng.write(ext, payload))
    back = bytearray(len(payload))
    eng.wait(eng.read(ext, back))
    out["roundtrip"] = {"device": by_nsid[1], "equal": bytes(back) == payload,
                        "written": sum(s.bytes_written for s in eng.stats())}
for nsid in (2, 3, 4):
    try:
        nvme.NvmeEngine.open([by_nsid[nsid]], job="guest-e2e").close()
        out["refused"][nsid] = None
    except DeviceUnsafeError as exc:
        out["refused"][nsid] = str(exc)

cxl = sorted({int(open(p).read()) for p in glob.glob("/sys/bus/dax/devices/dax*/target_node")})
out["cxl_nodes"] = cxl
with numa.NumaArena.allocate(4 * 4096, nodes=[cxl[0]]) as arena:   # a few pages: CXL is slow under TCG
    out["bound_pages"] = arena.node_of_pages()
with numa.NumaArena.allocate(8 * 4096, nodes=[0, cxl[0]], policy=numa.Policy.INTERLEAVE) as arena:
    out["interleaved_pages"] = arena.node_of_pages()
# The swap layer's activation-checkpoint pool, placed by the same rule the runtime uses (DMA-only data on CXL).
from memstrata.runtime.strata.affinity import TensorKind, place
from memstrata.runtime.strata.pinned import LockedPool
pool = LockedPool(4 * 4096, placement=place(TensorKind.ACTIVATIONS, dram_nodes=[0], cxl_nodes=cxl))
checkpoint = pool.take(3 * 4096)
out["activation_pages"] = pool.node_of_pages(checkpoint)
try:
    numa.NumaArena.allocate(4096, nodes=[7])
    out["missing_node_error"] = None
except Exception as exc:
    out["missing_node_error"] = f"{type(exc).__name__}: {exc}"
json.dump(out, open("/out/native.json", "w"))
'''


@pytest.fixture(scope="module")
def native() -> dict:
    reason = missing_reason()
    if reason:
        pytest.skip(f"QEMU GUEST UNAVAILABLE — {reason}")
    return json_from_guest(SCRIPT, "native.json")


def test_raw_nvme_round_trip_on_the_free_namespace(native: dict) -> None:
    rt = native["roundtrip"]
    assert rt["equal"], "bytes read back from the raw namespace differ from those written"
    assert rt["written"] >= (3 << 20) + 7


@pytest.mark.parametrize("nsid,reason", [(2, "ext4"), (3, "partition"), (4, "dm-0")])
def test_namespaces_holding_data_are_refused_with_the_reason(native: dict, nsid: int, reason: str) -> None:
    message = native["refused"][str(nsid)]
    assert message is not None, f"nsid {nsid} was opened for writing; it holds data"
    assert reason in message and "/dev/nvme0n" in message, message


def test_arena_bound_to_the_cxl_node_lands_there(native: dict) -> None:
    (cxl,) = native["cxl_nodes"]
    assert native["bound_pages"] == [cxl] * 4


def test_interleave_spreads_pages_over_dram_and_cxl(native: dict) -> None:
    (cxl,) = native["cxl_nodes"]
    pages = native["interleaved_pages"]
    assert sorted(set(pages)) == [0, cxl], pages
    assert pages.count(0) == pages.count(cxl) == 4


def test_activation_checkpoints_land_on_the_cxl_node(native: dict) -> None:
    """The pool memstrata.runtime.swap.activations copies each checkpoint into, on a node with DRAM and CXL."""
    (cxl,) = native["cxl_nodes"]
    assert native["activation_pages"] == [cxl] * 3


def test_binding_to_a_missing_node_names_it(native: dict) -> None:
    assert native["missing_node_error"] is not None and "7" in native["missing_node_error"]
