"""The one conversion of sampling to and from the wire (engine/proto/sampling.py)."""

from __future__ import annotations

import pytest

from pdunit.engine.model.sampling import SamplingParams
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto.sampling import sampling_from_pb, sampling_to_pb


def test_every_field_survives_the_round_trip() -> None:
    params = SamplingParams(temperature=0.9, top_k=40, seed=2**64 - 1, max_frames=300, min_frames=12)
    msg = sampling_to_pb(params)
    assert (msg.temperature, msg.top_k, msg.seed, msg.max_frames, msg.min_frames) == (
        0.9, 40, 2**64 - 1, 300, 12
    )
    assert sampling_from_pb(pb.Sampling.FromString(msg.SerializeToString())) == params


def test_a_max_frames_never_set_reads_as_one_frame() -> None:
    assert sampling_from_pb(pb.Sampling(temperature=0.5)) == SamplingParams(temperature=0.5, max_frames=1)


def test_values_sampling_refuses_raise_naming_the_field() -> None:
    with pytest.raises(ValueError, match="min_frames must be in"):
        sampling_from_pb(pb.Sampling(max_frames=4, min_frames=9))


def test_the_depth_decoders_params_survive_the_round_trip_set_zero_or_unset() -> None:
    for depth in ({}, {"depth_decoder_temperature": 0.0}, {"depth_decoder_top_k": 0},
                  {"depth_decoder_temperature": 1.5, "depth_decoder_top_k": 7}):
        params = SamplingParams(temperature=0.9, top_k=40, seed=3, max_frames=30, **depth)
        msg = pb.Sampling.FromString(sampling_to_pb(params).SerializeToString())
        assert msg.HasField("depth_decoder_temperature") == ("depth_decoder_temperature" in depth)
        assert sampling_from_pb(msg) == params and params.has_depth == bool(depth)
    with pytest.raises(ValueError, match="depth_decoder_top_k must be >= 0"):
        sampling_from_pb(pb.Sampling(max_frames=4, depth_decoder_top_k=-1))
