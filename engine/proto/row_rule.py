"""The one conversion between `RowRule` (engine/model/request_rules.py) and `pb.RowRule`.

Owns both directions of the family's row rule on the wire: D and the monolith put it on
their Hello, the LB reads it there and validates prompts with it. Must never change the
rule: it carries the fields as they are, and `RowRule` checks them when read.
"""

from __future__ import annotations

from typing import Any

from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.proto import pdunit_pb2 as pb


def row_rule_to_pb(rule: RowRule) -> pb.RowRule:
    return pb.RowRule(
        marker_column=rule.marker_column, marker_id=rule.marker_id, frame_columns=rule.frame_columns,
        code_limit=rule.code_limit, empty_ids=list(rule.empty_ids), frame_end_id=rule.frame_end_id,
        frame_end_code=rule.frame_end_code,
    )


def row_rule_from_hello(reply: pb.HelloReply) -> RowRule | None:
    """The Hello's rule (None: it carries none); ValueError for one `RowRule` refuses."""
    if not reply.HasField("row_rule"):
        return None
    m = reply.row_rule
    return RowRule(
        marker_column=m.marker_column, marker_id=m.marker_id, frame_columns=m.frame_columns,
        code_limit=m.code_limit, empty_ids=tuple(m.empty_ids), frame_end_id=m.frame_end_id,
        frame_end_code=m.frame_end_code,
    )


def hello_rules(row_rule: RowRule | None, depth_sampling: bool) -> dict[str, Any]:
    """HelloReply's fields of what a model requires of a request (`TTSModel.row_rule`,
    `TTSModel.depth_sampling`): `pb.HelloReply(..., **hello_rules(...))`."""
    return {"row_rule": row_rule_to_pb(row_rule) if row_rule is not None else None,
            "depth_decoder_sampling": depth_sampling}
