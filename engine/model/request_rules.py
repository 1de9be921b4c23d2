"""What a model requires of a request beyond row width and id ranges: a family's rules.

Owns `RowRule` (how a row's kind is read and what each kind may hold: csm's text rows
and audio-frame rows) and its check, which names the first bad row and column and what
was expected. The family writes the rule (engine/model/family_csm.py); the LB checks it
(engine/lb/validate.py, from D's Hello), P and the monolith again at Submit. numpy only
(the LB imports it), and never a family's name: the rule is data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowError:
    """The first row breaking the rule: its row, column, id and what was expected."""

    row: int
    column: int
    value: int
    expected: str

    def message(self) -> str:
        return f"prompt row {self.row} column {self.column} has id {self.value}: {self.expected}"


@dataclass(frozen=True)
class RowRule:
    """A row whose `marker_column` holds `marker_id` is an audio-frame row: its columns
    0..frame_columns-1 are codec codes in [0, code_limit). Any other row is a text row
    (the marker column its token): those columns hold one of `empty_ids` (csm: 0, as
    Sesame writes them, or codebook_pad_token_id), and its token is never `frame_end_id`
    (csm: audio_eos_token_id, which transformers embeds as a frame of `frame_end_code`s:
    write that frame row instead). `frame_end_id` -1: no such id."""

    marker_column: int
    marker_id: int
    frame_columns: int
    code_limit: int
    empty_ids: tuple[int, ...]
    frame_end_id: int = -1
    frame_end_code: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.frame_columns <= self.marker_column or self.code_limit < 1 or not self.empty_ids:
            raise ValueError(f"invalid row rule {self}")

    @property
    def width(self) -> int:
        return self.marker_column + 1

    def describe(self) -> str:
        """The rule in words (docs/api.md says the same)."""
        k, m = self.frame_columns, self.marker_column
        empty = " or ".join(str(i) for i in self.empty_ids)
        end = (f"; a text token {self.frame_end_id} is written as the audio-frame row of "
               f"{self.frame_end_code}s instead" if self.frame_end_id >= 0 else "")
        return (f"column {m} = {self.marker_id}: an audio-frame row, columns 0..{k - 1} codes in "
                f"[0, {self.code_limit}); else a text row, columns 0..{k - 1} {empty}{end}")

    def check(self, rows: np.ndarray) -> RowError | None:
        """The first (row-major) cell of `rows` [n, width] (ids already in their columns'
        ranges, or not: a negative id is caught too) that breaks the rule; None: none."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"rows have shape {rows.shape}, the rule reads rows of {self.width} ids")
        k, m = self.frame_columns, self.marker_column
        frame = rows[:, m] == self.marker_id
        codes = rows[:, :k]
        bad = np.zeros(rows.shape, dtype=bool)
        bad[:, :k] = np.where(frame[:, None], (codes < 0) | (codes >= self.code_limit),
                              ~np.isin(codes, np.asarray(self.empty_ids, dtype=codes.dtype)))
        if self.frame_end_id >= 0:
            bad[:, m] = ~frame & (rows[:, m] == self.frame_end_id)
        if not bad.any():
            return None
        r, c = divmod(int(np.argmax(bad.reshape(-1))), rows.shape[1])
        value = int(rows[r, c])
        if c == m:
            return RowError(r, c, value, (
                f"a text row may not hold {self.frame_end_id} (audio_eos_token_id): write the audio's "
                f"end as an audio-frame row, {self.frame_end_code} in columns 0..{k - 1} and "
                f"{self.marker_id} (audio_token_id) in column {m}"))
        if frame[r]:
            return RowError(r, c, value, (
                f"an audio-frame row (column {m} = {self.marker_id}, audio_token_id) holds codec "
                f"codes in [0, {self.code_limit}) in columns 0..{k - 1}"))
        empty = " or ".join(str(i) for i in self.empty_ids)
        return RowError(r, c, value, (
            f"a text row (column {m} is not {self.marker_id}, audio_token_id) holds {empty} in "
            f"columns 0..{k - 1} (Sesame writes 0, transformers codebook_pad_token_id); a code "
            f"there would be ignored"))
