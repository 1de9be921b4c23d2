"""P's and the monolith's Submit check the model family's rules again (issue 23): a csm
prompt row breaking its row rule, or depth_decoder_* sampling for a model without a
depth decoder, is answered INVALID naming row and column or the field, never queued and
never a crash; valid prompts are queued with their depth-decoder params. The D and the
monolith's Hello carry the rule to the LB (engine/proto/row_rule.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdunit.engine.model.loader import load_model
from pdunit.engine.model.request_rules import RowRule
from pdunit.engine.packing import pack
from pdunit.engine.prefill.scheduler import PrefillJob
from pdunit.engine.prefill.submit import NO_DEPTH_DECODER, serve_submit
from pdunit.engine.proto import pdunit_pb2 as pb
from pdunit.engine.proto.row_rule import hello_rules, row_rule_from_hello

TEXT = np.array([[31, 31, 31, 31, 7], [0, 0, 0, 0, 9]])
AUDIO = np.array([[1, 30, 0, 5, 62], [0, 0, 0, 0, 62]])


def submit(model, prompt: np.ndarray, **sampling) -> tuple[pb.SubmitReply, list[PrefillJob]]:
    req = pb.SubmitRequest(request_id=1, prompt=pack(prompt.astype(np.int64), "i8"), rows=len(prompt),
                           cols=prompt.shape[1], sampling=pb.Sampling(max_frames=4, **sampling))
    jobs: list[PrefillJob] = []

    def queue(job: PrefillJob) -> None:
        jobs.append(job)
        job.done(pb.SubmitReply(status=pb.STATUS_OK))

    reply = asyncio.run(serve_submit(req, model.config, queue, lambda rid: False, None,
                                     model.row_rule, model.depth_sampling))
    return reply, jobs


@pytest.fixture(scope="module")
def csm():
    return load_model("random:csm-tiny:0")


@pytest.mark.parametrize("row,column,value,words", [
    (2, 1, 5, "a text row (column 4 is not 62, audio_token_id) holds 0 or 31"),
    (2, 4, 61, "write the audio's end as an audio-frame row"),
])
def test_a_row_breaking_the_rule_is_invalid_naming_row_and_column(csm, row, column, value, words):
    prompt = np.concatenate([TEXT, TEXT[:1], AUDIO])
    prompt[row, column] = value
    reply, jobs = submit(csm, prompt)
    assert reply.status == pb.INVALID and not jobs
    assert reply.message.startswith(f"prompt row {row} column {column} has id {value}: ") and words in reply.message


def test_an_audio_code_past_the_codec_is_invalid():
    # csm-tiny's codec ids are its codebook vocabulary (32), so the column range refuses 32 first;
    # the rule itself refuses what the codec lacks below that
    rule = RowRule(marker_column=4, marker_id=62, frame_columns=4, code_limit=30, empty_ids=(0, 31))
    err = rule.check(np.concatenate([TEXT, AUDIO]))
    assert err is not None and (err.row, err.column, err.value) == (2, 1, 30)
    assert "codec codes in [0, 30)" in err.message()


def test_valid_prompts_are_queued_with_their_depth_params(csm):
    reply, jobs = submit(csm, np.concatenate([TEXT, AUDIO]), temperature=0.5, seed=3,
                         depth_decoder_temperature=0.0, depth_decoder_top_k=4)
    assert reply.status == pb.STATUS_OK, reply.message
    (job,) = jobs
    assert job.params.depth_decoder_temperature == 0.0 and job.params.depth_decoder_top_k == 4
    assert job.params.for_depth_decoder().temperature == 0.0 and job.params.for_depth_decoder().top_k == 4


def test_depth_params_without_a_depth_decoder_are_invalid_by_name():
    tiny = load_model("random:tiny:0")
    assert tiny.row_rule is None and not tiny.depth_sampling
    prompt = np.ones((3, tiny.config.n_codebooks), dtype=np.int64)
    for field in ({"depth_decoder_temperature": 0.5}, {"depth_decoder_top_k": 2}):
        reply, jobs = submit(tiny, prompt, **field)
        assert reply.status == pb.INVALID and reply.message == NO_DEPTH_DECODER and not jobs
    assert submit(tiny, prompt)[0].status == pb.STATUS_OK


def test_the_hello_carries_the_rule_both_ways(csm):
    reply = pb.HelloReply(n_codebooks=5, **hello_rules(csm.row_rule, csm.depth_sampling))
    assert reply.depth_decoder_sampling and row_rule_from_hello(reply) == csm.row_rule
    assert row_rule_from_hello(pb.HelloReply(**hello_rules(None, False))) is None
