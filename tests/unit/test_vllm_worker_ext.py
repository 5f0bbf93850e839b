"""The worker extension's quieting of vLLM's reload warnings (no vLLM needed: the filter is
plain ``logging``; tests/integration/test_vllm_generator.py checks it on a real engine)."""

import logging

import pytest

from tandem.generation.vllm_worker_ext import ExpectedUnloadedFilter


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, args, None)


@pytest.mark.parametrize(
    ("tied", "layer", "shown"),
    [
        (True, "RotaryEmbedding", False),
        (False, "Llama3RotaryEmbedding", False),
        (True, "ParallelLMHead", False),
        (False, "ParallelLMHead", True),  # untied: the head has a weight of its own to miss
        (True, "QKVParallelLinear", True),  # a weight the stream missed
        (True, "VocabParallelEmbedding", True),
    ],
)
def test_only_expected_layers_are_quieted(tied: bool, layer: str, shown: bool) -> None:
    assert (
        ExpectedUnloadedFilter(tied).filter(_record(ExpectedUnloadedFilter.MESSAGE, layer)) is shown
    )


def test_other_messages_pass() -> None:
    quiet = ExpectedUnloadedFilter(tied_lm_head=True)
    assert quiet.filter(_record("%s: Delayed processing", "RotaryEmbedding"))
    assert quiet.filter(_record("Failed to load weights"))
