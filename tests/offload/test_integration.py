"""The integration module: version gate, and DeepSpeed's own classes back in place after initialize."""
from __future__ import annotations

import pytest

from memstrata.runtime.swap.integration import SUPPORTED_DEEPSPEED, UnsupportedDeepSpeed, check_version


def test_another_deepspeed_is_refused_with_both_versions() -> None:
    with pytest.raises(UnsupportedDeepSpeed, match=r"supports DeepSpeed 0\.19\.8 only; found 0\.18\.3"):
        check_version("0.18.3")
    assert check_version(f"{SUPPORTED_DEEPSPEED}+cpu ") == f"{SUPPORTED_DEEPSPEED}+cpu"


@pytest.mark.usefixtures("deepspeed_ready")
def test_swappers_are_replaced_only_inside_the_call() -> None:
    from deepspeed.runtime.zero import partition_parameters, stage3

    from memstrata.runtime.swap.integration import _swappers_installed
    from memstrata.runtime.swap.optimizer import MemstrataOptimizerSwapper
    from memstrata.runtime.swap.parameters import MemstrataParamSwapper

    stock = (partition_parameters.AsyncPartitionedParameterSwapper, stage3.PartitionedOptimizerSwapper,
             stage3.PipelinedOptimizerSwapper)
    with pytest.raises(RuntimeError, match="boom"), _swappers_installed():
        assert partition_parameters.AsyncPartitionedParameterSwapper is MemstrataParamSwapper
        assert stage3.PartitionedOptimizerSwapper is MemstrataOptimizerSwapper
        assert stage3.PipelinedOptimizerSwapper is MemstrataOptimizerSwapper
        raise RuntimeError("boom")
    assert (partition_parameters.AsyncPartitionedParameterSwapper, stage3.PartitionedOptimizerSwapper,
            stage3.PipelinedOptimizerSwapper) == stock


def test_swap_settings_reject_bad_values() -> None:
    from pydantic import ValidationError

    from memstrata.runtime.swap.layer import SwapSettings

    with pytest.raises(ValidationError, match="io_token_limit"):
        SwapSettings(io_token_limit=0)
