from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    HOST_SHM: _ClassVar[RegionKind]
    CUDA_IPC: _ClassVar[RegionKind]
    CUDA_POSIX_FD: _ClassVar[RegionKind]

class CopyMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METHOD_AUTO: _ClassVar[CopyMethod]
    SINGLE_KERNEL: _ClassVar[CopyMethod]
    STAGED: _ClassVar[CopyMethod]
REGION_KIND_UNSPECIFIED: RegionKind
HOST_SHM: RegionKind
CUDA_IPC: RegionKind
CUDA_POSIX_FD: RegionKind
METHOD_AUTO: CopyMethod
SINGLE_KERNEL: CopyMethod
STAGED: CopyMethod

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Layout(_message.Message):
    __slots__ = ("n_layers", "n_kv_heads", "head_dim", "dtype", "n_slots")
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    N_SLOTS_FIELD_NUMBER: _ClassVar[int]
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    n_slots: int
    def __init__(self, n_layers: _Optional[int] = ..., n_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., n_slots: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "kind", "layout", "size_bytes", "gpu_uuid", "ipc_handle", "offset_bytes", "owner_pid", "owner_fd", "alloc_bytes", "shm_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FD_FIELD_NUMBER: _ClassVar[int]
    ALLOC_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    layout: Layout
    size_bytes: int
    gpu_uuid: str
    ipc_handle: bytes
    offset_bytes: int
    owner_pid: int
    owner_fd: int
    alloc_bytes: int
    shm_name: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., size_bytes: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., offset_bytes: _Optional[int] = ..., owner_pid: _Optional[int] = ..., owner_fd: _Optional[int] = ..., alloc_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    def __init__(self, region_id: _Optional[str] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    def __init__(self, region_id: _Optional[str] = ...) -> None: ...

class CopyRequest(_message.Message):
    __slots__ = ("request_id", "src_region", "src_slots", "dst_region", "dst_slots", "deadline_unix_ms", "method", "verify", "client_send_ns", "capability", "session")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_REGION_FIELD_NUMBER: _ClassVar[int]
    SRC_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DST_REGION_FIELD_NUMBER: _ClassVar[int]
    DST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SEND_NS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    src_region: str
    src_slots: bytes
    dst_region: str
    dst_slots: bytes
    deadline_unix_ms: int
    method: CopyMethod
    verify: bool
    client_send_ns: int
    capability: bytes
    session: str
    def __init__(self, request_id: _Optional[int] = ..., src_region: _Optional[str] = ..., src_slots: _Optional[bytes] = ..., dst_region: _Optional[str] = ..., dst_slots: _Optional[bytes] = ..., deadline_unix_ms: _Optional[int] = ..., method: _Optional[_Union[CopyMethod, str]] = ..., verify: _Optional[bool] = ..., client_send_ns: _Optional[int] = ..., capability: _Optional[bytes] = ..., session: _Optional[str] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("region_id", "request_id", "capability", "dst_slots", "deadline_unix_ms", "any_request")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    DST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ANY_REQUEST_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    request_id: int
    capability: bytes
    dst_slots: bytes
    deadline_unix_ms: int
    any_request: bool
    def __init__(self, region_id: _Optional[str] = ..., request_id: _Optional[int] = ..., capability: _Optional[bytes] = ..., dst_slots: _Optional[bytes] = ..., deadline_unix_ms: _Optional[int] = ..., any_request: _Optional[bool] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("region_id", "request_id")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    request_id: int
    def __init__(self, region_id: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class CopyReply(_message.Message):
    __slots__ = ("method", "bytes", "device_seconds", "src_checksum", "dst_checksum", "stage_seconds", "proxy_done_ns")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SRC_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DST_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROXY_DONE_NS_FIELD_NUMBER: _ClassVar[int]
    method: str
    bytes: int
    device_seconds: float
    src_checksum: int
    dst_checksum: int
    stage_seconds: _containers.ScalarMap[str, float]
    proxy_done_ns: int
    def __init__(self, method: _Optional[str] = ..., bytes: _Optional[int] = ..., device_seconds: _Optional[float] = ..., src_checksum: _Optional[int] = ..., dst_checksum: _Optional[int] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., proxy_done_ns: _Optional[int] = ...) -> None: ...

class LaneReply(_message.Message):
    __slots__ = ("reply", "code", "message")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reply: CopyReply
    code: str
    message: str
    def __init__(self, reply: _Optional[_Union[CopyReply, _Mapping]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class QuiesceRequest(_message.Message):
    __slots__ = ("request_ids", "cancel", "wait_ms")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    request_ids: bytes
    cancel: bool
    wait_ms: int
    def __init__(self, request_ids: _Optional[bytes] = ..., cancel: _Optional[bool] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class QuiesceReply(_message.Message):
    __slots__ = ("quiesced", "running")
    QUIESCED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    quiesced: bool
    running: bytes
    def __init__(self, quiesced: _Optional[bool] = ..., running: _Optional[bytes] = ...) -> None: ...

class InFlightReply(_message.Message):
    __slots__ = ("request_ids", "jobs_running")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    JOBS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    request_ids: bytes
    jobs_running: int
    def __init__(self, request_ids: _Optional[bytes] = ..., jobs_running: _Optional[int] = ...) -> None: ...

class RegionInfo(_message.Message):
    __slots__ = ("region_id", "name", "kind", "layout", "gpu_uuid", "owner_pid")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    name: str
    kind: RegionKind
    layout: Layout
    gpu_uuid: str
    owner_pid: int
    def __init__(self, region_id: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., gpu_uuid: _Optional[str] = ..., owner_pid: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("instance_id", "regions", "gpu_uuids", "version", "copy_kernel", "copy_device", "session_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COPY_KERNEL_FIELD_NUMBER: _ClassVar[int]
    COPY_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    version: str
    copy_kernel: str
    copy_device: str
    session_id: str
    def __init__(self, instance_id: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., version: _Optional[str] = ..., copy_kernel: _Optional[str] = ..., copy_device: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...
