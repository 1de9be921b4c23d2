from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_OK: _ClassVar[Status]
    NO_CAPACITY: _ClassVar[Status]
    STALE_INSTANCE: _ClassVar[Status]
    DEADLINE_EXCEEDED: _ClassVar[Status]
    CHECKSUM_MISMATCH: _ClassVar[Status]
    UNKNOWN_REQUEST: _ClassVar[Status]
    CANCELLED: _ClassVar[Status]
    TRANSFER_FAILED: _ClassVar[Status]
    INVALID: _ClassVar[Status]
    DRAINING: _ClassVar[Status]
    INTERNAL: _ClassVar[Status]
    RATE_FLOOR: _ClassVar[Status]
STATUS_OK: Status
NO_CAPACITY: Status
STALE_INSTANCE: Status
DEADLINE_EXCEEDED: Status
CHECKSUM_MISMATCH: Status
UNKNOWN_REQUEST: Status
CANCELLED: Status
TRANSFER_FAILED: Status
INVALID: Status
DRAINING: Status
INTERNAL: Status
RATE_FLOOR: Status

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "seed", "max_frames", "min_frames", "depth_decoder_temperature", "depth_decoder_top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_DECODER_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_DECODER_TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    seed: int
    max_frames: int
    min_frames: int
    depth_decoder_temperature: float
    depth_decoder_top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., depth_decoder_temperature: _Optional[float] = ..., depth_decoder_top_k: _Optional[int] = ...) -> None: ...

class Stamps(_message.Message):
    __slots__ = ("ns",)
    class NsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NS_FIELD_NUMBER: _ClassVar[int]
    ns: _containers.ScalarMap[str, int]
    def __init__(self, ns: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Identity(_message.Message):
    __slots__ = ("sender_instance", "receiver_instance", "budget_ms")
    SENDER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    sender_instance: str
    receiver_instance: str
    budget_ms: int
    def __init__(self, sender_instance: _Optional[str] = ..., receiver_instance: _Optional[str] = ..., budget_ms: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "rows", "cols", "sampling", "deadline_unix_ms", "stamps", "audio")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STAMPS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prompt: bytes
    rows: int
    cols: int
    sampling: Sampling
    deadline_unix_ms: int
    stamps: Stamps
    audio: bool
    def __init__(self, request_id: _Optional[int] = ..., prompt: _Optional[bytes] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., stamps: _Optional[_Union[Stamps, _Mapping]] = ..., audio: _Optional[bool] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("status", "message", "prefill_tokens", "cached_tokens", "stamps")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STAMPS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    prefill_tokens: int
    cached_tokens: int
    stamps: Stamps
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., prefill_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., stamps: _Optional[_Union[Stamps, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "status", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    status: Status
    message: str
    def __init__(self, request_id: _Optional[int] = ..., status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "identity")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    identity: Identity
    def __init__(self, request_id: _Optional[int] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("ack", "instance_id")
    ACK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ack: bool
    instance_id: str
    def __init__(self, ack: _Optional[bool] = ..., instance_id: _Optional[str] = ...) -> None: ...

class PoolGeometry(_message.Message):
    __slots__ = ("n_layers", "n_kv_heads", "head_dim", "dtype", "n_slots", "page_size")
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    N_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    n_slots: int
    page_size: int
    def __init__(self, n_layers: _Optional[int] = ..., n_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., n_slots: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...

class TransportDescriptor(_message.Message):
    __slots__ = ("mode", "params", "handle")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    params: _containers.ScalarMap[str, str]
    handle: bytes
    def __init__(self, mode: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., handle: _Optional[bytes] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("sender_instance",)
    SENDER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    sender_instance: str
    def __init__(self, sender_instance: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("instance_id", "geometry", "transports", "n_codebooks", "vocab_sizes", "eos_id", "model", "audio_format", "row_rule", "depth_decoder_sampling", "frame_rate_hz")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    N_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZES_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ROW_RULE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_DECODER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    geometry: PoolGeometry
    transports: _containers.RepeatedCompositeFieldContainer[TransportDescriptor]
    n_codebooks: int
    vocab_sizes: bytes
    eos_id: int
    model: str
    audio_format: AudioFormat
    row_rule: RowRule
    depth_decoder_sampling: bool
    frame_rate_hz: float
    def __init__(self, instance_id: _Optional[str] = ..., geometry: _Optional[_Union[PoolGeometry, _Mapping]] = ..., transports: _Optional[_Iterable[_Union[TransportDescriptor, _Mapping]]] = ..., n_codebooks: _Optional[int] = ..., vocab_sizes: _Optional[bytes] = ..., eos_id: _Optional[int] = ..., model: _Optional[str] = ..., audio_format: _Optional[_Union[AudioFormat, _Mapping]] = ..., row_rule: _Optional[_Union[RowRule, _Mapping]] = ..., depth_decoder_sampling: _Optional[bool] = ..., frame_rate_hz: _Optional[float] = ...) -> None: ...

class RowRule(_message.Message):
    __slots__ = ("marker_column", "marker_id", "frame_columns", "code_limit", "empty_ids", "frame_end_id", "frame_end_code")
    MARKER_COLUMN_FIELD_NUMBER: _ClassVar[int]
    MARKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    CODE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EMPTY_IDS_FIELD_NUMBER: _ClassVar[int]
    FRAME_END_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_END_CODE_FIELD_NUMBER: _ClassVar[int]
    marker_column: int
    marker_id: int
    frame_columns: int
    code_limit: int
    empty_ids: _containers.RepeatedScalarFieldContainer[int]
    frame_end_id: int
    frame_end_code: int
    def __init__(self, marker_column: _Optional[int] = ..., marker_id: _Optional[int] = ..., frame_columns: _Optional[int] = ..., code_limit: _Optional[int] = ..., empty_ids: _Optional[_Iterable[int]] = ..., frame_end_id: _Optional[int] = ..., frame_end_code: _Optional[int] = ...) -> None: ...

class AudioFormat(_message.Message):
    __slots__ = ("sample_rate", "samples_per_frame", "frame_rate_hz", "codec")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    samples_per_frame: int
    frame_rate_hz: float
    codec: str
    def __init__(self, sample_rate: _Optional[int] = ..., samples_per_frame: _Optional[int] = ..., frame_rate_hz: _Optional[float] = ..., codec: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "n_tokens", "deadline_unix_ms", "identity", "total_tokens", "audio")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    n_tokens: int
    deadline_unix_ms: int
    identity: Identity
    total_tokens: int
    audio: bool
    def __init__(self, request_id: _Optional[int] = ..., n_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ..., total_tokens: _Optional[int] = ..., audio: _Optional[bool] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("status", "message", "dst_slots", "instance_id", "capability")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    dst_slots: bytes
    instance_id: str
    capability: bytes
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., dst_slots: _Optional[bytes] = ..., instance_id: _Optional[str] = ..., capability: _Optional[bytes] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "first_frame", "checksum", "checksum_sample", "sampling", "prompt_tokens", "identity", "stamps", "audio")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    STAMPS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    first_frame: bytes
    checksum: int
    checksum_sample: int
    sampling: Sampling
    prompt_tokens: int
    identity: Identity
    stamps: Stamps
    audio: bool
    def __init__(self, request_id: _Optional[int] = ..., first_frame: _Optional[bytes] = ..., checksum: _Optional[int] = ..., checksum_sample: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ..., stamps: _Optional[_Union[Stamps, _Mapping]] = ..., audio: _Optional[bool] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("status", "message", "instance_id")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    instance_id: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class FramesRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("request_id", "status", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    status: Status
    message: str
    def __init__(self, request_id: _Optional[int] = ..., status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ...) -> None: ...

class StepFrames(_message.Message):
    __slots__ = ("step", "request_ids", "frames", "finished", "errors", "step_unix_ns", "stamps", "audio")
    class StampsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: Stamps
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[Stamps, _Mapping]] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    STEP_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STAMPS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    step: int
    request_ids: bytes
    frames: bytes
    finished: bytes
    errors: _containers.RepeatedCompositeFieldContainer[StreamError]
    step_unix_ns: int
    stamps: _containers.MessageMap[int, Stamps]
    audio: _containers.RepeatedCompositeFieldContainer[AudioChunk]
    def __init__(self, step: _Optional[int] = ..., request_ids: _Optional[bytes] = ..., frames: _Optional[bytes] = ..., finished: _Optional[bytes] = ..., errors: _Optional[_Iterable[_Union[StreamError, _Mapping]]] = ..., step_unix_ns: _Optional[int] = ..., stamps: _Optional[_Mapping[int, Stamps]] = ..., audio: _Optional[_Iterable[_Union[AudioChunk, _Mapping]]] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("request_id", "pcm", "first_frame", "frames", "last")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    pcm: bytes
    first_frame: int
    frames: int
    last: bool
    def __init__(self, request_id: _Optional[int] = ..., pcm: _Optional[bytes] = ..., first_frame: _Optional[int] = ..., frames: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("role", "instance_id", "peer_instance_id", "queue", "in_flight", "held_pages", "pool_pages", "free_pages", "held_aborts", "draining", "transfer_mode", "kv_checks_total", "kv_mismatch_total", "request_ids", "pid", "unready", "headroom_streams")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_ABORTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_MISMATCH_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UNREADY_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    role: str
    instance_id: str
    peer_instance_id: str
    queue: int
    in_flight: int
    held_pages: int
    pool_pages: int
    free_pages: int
    held_aborts: int
    draining: bool
    transfer_mode: str
    kv_checks_total: int
    kv_mismatch_total: int
    request_ids: bytes
    pid: int
    unready: str
    headroom_streams: int
    def __init__(self, role: _Optional[str] = ..., instance_id: _Optional[str] = ..., peer_instance_id: _Optional[str] = ..., queue: _Optional[int] = ..., in_flight: _Optional[int] = ..., held_pages: _Optional[int] = ..., pool_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., held_aborts: _Optional[int] = ..., draining: _Optional[bool] = ..., transfer_mode: _Optional[str] = ..., kv_checks_total: _Optional[int] = ..., kv_mismatch_total: _Optional[int] = ..., request_ids: _Optional[bytes] = ..., pid: _Optional[int] = ..., unready: _Optional[str] = ..., headroom_streams: _Optional[int] = ...) -> None: ...
