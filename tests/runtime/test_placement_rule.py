"""Which NUMA nodes each kind of swap buffer is bound to (memstrata.runtime.strata.affinity.place): DRAM for
the optimizer's operands, CXL for DMA-only staging, and no binding at all where there is nothing to choose —
a container under the default seccomp profile may not call mbind (it needs CAP_SYS_NICE)."""
from __future__ import annotations

import pytest

from memstrata.runtime.strata.affinity import Placement, TensorKind, place
from memstrata.runtime.strata.numa import Policy


@pytest.mark.parametrize("kind", list(TensorKind))
def test_one_memory_node_binds_nothing(kind: TensorKind) -> None:
    assert place(kind, dram_nodes=[0], cxl_nodes=[]) == Placement((), Policy.BIND)
    assert place(kind, dram_nodes=[], cxl_nodes=[]).nodes == ()


def test_the_optimizer_stays_in_dram_beside_cxl_and_dma_only_data_is_striped_over_cxl() -> None:
    assert place(TensorKind.OPTIMIZER, dram_nodes=[0], cxl_nodes=[2, 3]) == Placement((0,), Policy.BIND)
    assert place(TensorKind.PARAM_STAGING, dram_nodes=[0], cxl_nodes=[3, 2]) == Placement((2, 3), Policy.INTERLEAVE)
    assert place(TensorKind.ACTIVATIONS, dram_nodes=[0, 1], cxl_nodes=[2]) == Placement((2,), Policy.INTERLEAVE)


def test_several_dram_nodes_spread_the_optimizer() -> None:
    for kind in TensorKind:
        assert place(kind, dram_nodes=[1, 0], cxl_nodes=[]) == Placement((0, 1), Policy.INTERLEAVE)


def test_a_node_listed_as_both_is_refused() -> None:
    with pytest.raises(ValueError, match=r"NUMA nodes \[1\] are listed as both DRAM and CXL"):
        place(TensorKind.OPTIMIZER, dram_nodes=[0, 1], cxl_nodes=[1])
