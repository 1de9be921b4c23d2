"""`pdunit bench step` pieces that need no GPU: the fragmented context layout, the
command line, and the refusal to run without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdunit.bench import step


def test_paged_contexts_are_distinct_whole_pages_of_the_pool() -> None:
    ctx = step.paged_contexts(4, 40, 16, 1024, np.random.default_rng(0))
    assert [len(c) for c in ctx] == [40] * 4
    every = np.concatenate(ctx)
    assert len(set(every.tolist())) == every.size and every.max() < 1024
    for c in ctx:
        assert (c[:16] // 16 == c[0] // 16).all() and c[0] % 16 == 0


def test_bad_batch_list_is_rejected_naming_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        step._parser().parse_args(["--batches", "1,x"])
    assert "expected comma-separated integers, got '1,x'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_run_step_without_cuda_says_it_needs_a_gpu() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        step.run_step(step.StepConfig())
