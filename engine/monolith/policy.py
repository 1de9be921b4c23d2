"""The monolith's `budget` policy: how many prompt rows one step carries so that the
decoding streams keep their rate floor (Sarathi-Serve's stall-free batching, with the
floor's step budget as the token budget).

Owns the planning function (`budget_rows`, pure) and the trust limit on rows
(`RowBudget`). The step is priced by the admission's StepModel against the same budget
admission judges with (engine/decode/admission.py: 1 / floor less `--floor-margin`,
shrunk when the model under-predicts). Must never plan zero rows while a prompt waits
(one block, `--prefix-block-tokens` rows, always makes progress) and never plan by a
price the model has not earned: rows follow admission's trust rule (below).
"""

from __future__ import annotations

from pdunit.engine.decode.admission import AdmissionControl
from pdunit.engine.decode.step_model import StepCoefficients


def budget_rows(model: StepCoefficients, budget_ms: float, streams: int, context_tokens: int,
                block_rows: int, max_rows: int, trusted_rows: int | None = None) -> int:
    """Prompt rows for one step of `streams` decoding streams over `context_tokens`.

    No decoding stream: `max_rows` (prefill-first's forward, `--max-batch-rows`: nobody
    waits for it, so the prompt runs whole). Otherwise the most rows, a multiple of
    `block_rows`, with model.ms(streams, context, rows) <= `budget_ms`, at most
    `trusted_rows` (None: no limit) and `max_rows`; never fewer than `block_rows` (when
    the decode batch alone fills the budget, one block still makes progress), unless
    `max_rows` is smaller. A model with no per-row cost prices rows as free: only the
    trust limit and `max_rows` bound them."""
    if block_rows <= 0 or max_rows <= 0:
        raise ValueError(f"block_rows ({block_rows}) and max_rows ({max_rows}) must be > 0")
    if streams <= 0:
        return max_rows
    fit = max_rows
    if model.per_row_ms > 0:
        spare = budget_ms - model.ms(streams, context_tokens)
        fit = int(spare // model.per_row_ms) if spare > 0 else 0
    if trusted_rows is not None:
        fit = min(fit, trusted_rows)
    fit = min(fit, max_rows) // block_rows * block_rows
    return min(max_rows, max(block_rows, fit))


class RowBudget:
    """The `budget` policy's state: the admission it prices with, and the widest prompt
    rows of a step observed. Admission trusts a model without a `--step-model` fit for
    twice the widest step it has seen (at least `--cold-streams`); rows get the same
    rule: unless the fit file has a per-row term (`per_row_ms` > 0), a step carries at
    most twice the most prompt rows one observed step carried (at least one block), so
    a model that never priced a row cannot plan a large chunk beside decoding streams.
    With such a fit file the model alone prices them."""

    def __init__(self, admission: AdmissionControl, block_rows: int, max_rows: int) -> None:
        self.admission = admission
        self.block_rows = block_rows
        self.max_rows = max_rows
        self.widest_rows = 0

    def trusted_rows(self) -> int | None:
        if self.admission.seeded and self.admission.model.seed.per_row_ms > 0:
            return None
        return max(self.block_rows, 2 * self.widest_rows)

    def rows(self, streams: int, context_tokens: int) -> int:
        return budget_rows(self.admission.model.coefficients, self.admission.admission.budget_ms(), streams,
                           context_tokens, self.block_rows, self.max_rows, self.trusted_rows())

    def observe(self, prefill_rows: int) -> None:
        self.widest_rows = max(self.widest_rows, prefill_rows)
