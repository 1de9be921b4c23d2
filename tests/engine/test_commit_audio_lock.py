"""D's COMMIT decodes an audio stream's first chunk outside the engine lock (docs/audio.md):
Reserve, Cancel and Info never wait for the codec; the first frame still goes out with its
chunk at COMMIT, before any step decodes the stream; a Cancel meanwhile ends it."""

from __future__ import annotations

import numpy as np

from pdunit.engine.packing import unpack
from pdunit.engine.proto import pdunit_pb2 as pb
from tests.engine.test_codec_serving import (
    audio_rows,
    chunks_of,
    codec,
    commit,
    decode_engine,
    model,
)

__all__ = ["codec", "model"]  # pytest fixtures, imported


def test_the_first_chunk_is_decoded_outside_the_engine_lock(model, codec) -> None:
    d, hub = decode_engine(model, codec)
    assert d.codec is not None
    seen: list[tuple[bool, bool, int]] = []
    decode = d.codec.decoder.decode

    def spy(slots, codes, **kw):
        if not seen:  # COMMIT's: the engine lock is free, the stream held but not in the batch yet
            seen.append((d._lock.locked(), 1 in d.batcher.request_ids(), len(d._lifetimes())))
            assert d.info().in_flight == 0  # Info answers meanwhile
        return decode(slots, codes, **kw)

    d.codec.decoder.decode = spy  # type: ignore[method-assign]
    assert commit(d, 1, audio_rows(1, 1)[0], audio=True, max_frames=6, min_frames=6).status == pb.STATUS_OK
    assert seen == [(False, False, 1)]
    (msg,) = hub.messages  # the first frame with its chunk, at COMMIT
    assert unpack(msg.request_ids, "u8").tolist() == [1] and [c.frames for c in msg.audio] == [1]
    assert 1 in d.batcher.request_ids() and not d._committing
    while d._step_once():
        pass
    assert sum(c.frames for c in chunks_of(hub.messages, 1)) == 6
    assert chunks_of(hub.messages, 1)[-1].last and d.codec.decoder.open_streams == 0


def test_a_cancel_while_the_first_chunk_is_decoded_ends_the_stream(model, codec) -> None:
    d, hub = decode_engine(model, codec)
    assert d.codec is not None
    free_before = d.pool.free_pages
    decode = d.codec.decoder.decode

    def cancel_meanwhile(slots, codes, **kw):
        assert d.cancel(2)  # found: committing
        return decode(slots, codes, **kw)

    d.codec.decoder.decode = cancel_meanwhile  # type: ignore[method-assign]
    assert commit(d, 2, audio_rows(2, 1)[0], audio=True, max_frames=6, min_frames=6).status == pb.STATUS_OK
    assert 2 not in d.batcher.request_ids() and not d._committing and not d._committing_cancelled
    assert 2 not in d.codec and d.codec.decoder.open_streams == 0
    assert d.pool.free_pages == free_before
    assert not d._step_once()  # nothing to decode
    assert np.array_equal(unpack(hub.messages[0].request_ids, "u8"), np.array([2], np.uint64))


def test_a_frames_stream_commits_as_before(model, codec) -> None:
    d, hub = decode_engine(model, codec)
    assert commit(d, 3, audio_rows(3, 1)[0], audio=False, max_frames=4, min_frames=4).status == pb.STATUS_OK
    (msg,) = hub.messages
    assert not msg.audio and 3 in d.batcher.request_ids()
