"""The one conversion between `SamplingParams` (engine/model/sampling.py) and `pb.Sampling`.

Owns both directions, for every hop sampling makes on the wire (P reads the LB's Submit,
P commits to D, D reads the Commit). Must never check or change a field beyond what
`SamplingParams` checks: one set of rules, so every role samples alike. It lives beside
the proto because engine/model imports no protocol.
"""

from __future__ import annotations

from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.proto import pdunit_pb2 as pb


def sampling_to_pb(params: SamplingParams) -> pb.Sampling:
    return pb.Sampling(
        temperature=params.temperature,
        top_k=params.top_k,
        seed=params.seed,
        max_frames=params.max_frames,
        min_frames=params.min_frames,
        depth_decoder_temperature=params.depth_decoder_temperature,
        depth_decoder_top_k=params.depth_decoder_top_k,
    )


def sampling_from_pb(msg: pb.Sampling) -> SamplingParams:
    """ValueError (naming the field) for values SamplingParams refuses. A max_frames never
    set reads 0 in proto3: taken as 1, the frame prefill always produces. The depth-decoder
    fields are optional: unset reads None (the main ones)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        seed=msg.seed,
        max_frames=max(1, msg.max_frames),
        min_frames=msg.min_frames,
        depth_decoder_temperature=(
            msg.depth_decoder_temperature if msg.HasField("depth_decoder_temperature") else None
        ),
        depth_decoder_top_k=msg.depth_decoder_top_k if msg.HasField("depth_decoder_top_k") else None,
    )
