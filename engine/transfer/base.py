"""The KV transfer interface every transport implements (the modes of settings.TransferMode).

Owns `KVReceiver` (in D: D's pool storage, and `descriptors()`, sent to P in HelloReply,
saying how to reach it), `KVSender` (in P: attaches to one descriptor and writes rows
`src[:, :, src_slots[i]] -> dst[:, :, dst_slots[i]]` of pools `[n_layers, 2, n_slots,
n_kv_heads, head_dim]`), the write capabilities (`WriteGrants`, PROTOCOL.md 3.1) and the
quiesce proof (`KVSender.quiesce`, 3.5). The exchange (RESERVE -> write -> COMMIT,
ABORT/ABORT_ACK) is the workers' job over gRPC (engine/proto): a transport only moves rows
and answers the quiesce question. Must never decide page ownership: D's pool does.
"""

from __future__ import annotations

import abc
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import get_args

import numpy as np
import torch

from pdunit.engine.settings import TransferMode

# The concrete modes (auto chooses one of them), from the one list in settings.
TRANSFER_MODES: tuple[str, ...] = tuple(m for m in get_args(TransferMode) if m != "auto")


class TransferError(RuntimeError):
    """A write failed; `retryable` says whether the same transport may be tried again."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class PoolGeometry:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    n_slots: int
    page_size: int

    @property
    def row_bytes(self) -> int:
        return self.n_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def bytes_for(self, n_tokens: int) -> int:
        return self.n_layers * 2 * n_tokens * self.row_bytes

    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.n_layers, 2, self.n_slots, self.n_kv_heads, self.head_dim)


def exact_pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Seeded random integers, exact in `dtype` (fp8 e4m3 holds every integer up to 16,
    the others up to 2**14): probe rows without NaNs that survive the cast unchanged."""
    bound = 16 if torch.empty((), dtype=dtype).element_size() == 1 else 1 << 14
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-bound, bound + 1, shape, generator=gen, dtype=torch.int32).to(dtype)


@dataclass
class Descriptor:
    """How a sender reaches a receiver; mirrors pdunit.v1.TransportDescriptor."""

    mode: str
    params: dict[str, str] = field(default_factory=dict)
    handle: bytes = b""


CAPABILITY_BYTES = 32


@dataclass
class _Grant:
    capability: bytes
    slots: np.ndarray  # sorted, unique
    deadline_unix_ms: int


class WriteGrants:
    """The live reservations' write capabilities, one per request id: `grant` at
    RESERVE, `check` before applying any write, `revoke` at COMMIT / ABORT / held.
    Thread-safe. A capability is 32 random bytes, compared in constant time.

    The capabilities of the latest `memory` ended reservations are remembered, so a
    receiver can tell the writer that was authorised and is now late (a stalled P whose
    reservation D gave up on: `late`) from a write that never was (an attack or a bug)."""

    def __init__(self, memory: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._grants: dict[int, _Grant] = {}
        self._memory = memory
        self._ended: OrderedDict[int, bytes] = OrderedDict()

    def grant(self, request_id: int, dst_slots: np.ndarray, deadline_unix_ms: int,
              capability: bytes | None = None) -> bytes:
        """A new capability for this reservation (or `capability`, when several receivers
        share one reservation: `auto`'s parts)."""
        if capability is None:
            capability = secrets.token_bytes(CAPABILITY_BYTES)
        elif len(capability) != CAPABILITY_BYTES:
            raise ValueError(f"a write capability has {CAPABILITY_BYTES} bytes, got {len(capability)}")
        slots = np.unique(np.asarray(dst_slots, dtype=np.int64).reshape(-1))
        with self._lock:
            self._grants[request_id] = _Grant(bytes(capability), slots, deadline_unix_ms)
            self._ended.pop(request_id, None)
        return bytes(capability)

    def check(self, request_id: int, capability: bytes, dst_slots: np.ndarray, exact: bool = False) -> str:
        """"" when a write of `dst_slots` for `request_id` with `capability` may be
        applied now; else why not (the caller refuses and reports a security event).
        `exact`: the write must cover exactly the reservation's slots (a transfer that
        declares its whole destination up front, tcp's BEGIN)."""
        with self._lock:
            g = self._grants.get(request_id)
        if g is None:
            return f"request {request_id} has no live reservation (never reserved, committed or aborted)"
        if not hmac.compare_digest(g.capability, bytes(capability)):
            return f"request {request_id}: wrong write capability"
        if g.deadline_unix_ms and time.time() * 1000.0 > g.deadline_unix_ms:
            return f"request {request_id}: its reservation's deadline passed"
        want = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
        if want.size:
            at = np.minimum(np.searchsorted(g.slots, want), max(0, g.slots.size - 1))
            if not g.slots.size or not bool((g.slots[at] == want).all()):
                return f"request {request_id}: destination slots outside its reservation"
        if exact and (covered := np.unique(want).size) != g.slots.size:
            return (f"request {request_id}: the write covers {covered} of its reservation's "
                    f"{g.slots.size} slots; it must declare all of them")
        return ""

    def late(self, request_id: int, capability: bytes) -> bool:
        """True when `capability` is (or was) this request's own and only time stops the
        write: the reservation ended (revoked) or its deadline passed. Such a write is
        refused as late, not reported as an attack."""
        with self._lock:
            g = self._grants.get(request_id)
            ended = self._ended.get(request_id)
        if g is not None:
            expired = bool(g.deadline_unix_ms) and time.time() * 1000.0 > g.deadline_unix_ms
            return expired and hmac.compare_digest(g.capability, bytes(capability))
        return ended is not None and hmac.compare_digest(ended, bytes(capability))

    def revoke(self, request_id: int) -> None:
        with self._lock:
            g = self._grants.pop(request_id, None)
            if g is not None:
                self._ended[request_id] = g.capability
                while len(self._ended) > self._memory:
                    self._ended.popitem(last=False)

    def __contains__(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._grants

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)


class KVReceiver(abc.ABC):
    """D's side: owns the pool storage that D's model reads and writes.

    Write capabilities (PROTOCOL.md 3.1): D's RESERVE calls `grant`, which returns an
    unguessable capability bound to that reservation's slots; P's writes carry it
    (`KVSender.write(..., capability=)`). A receiver through which another process writes
    (tcp's listener, the proxy) refuses any write without the capability, outside its
    slots, or after `revoke` (COMMIT, ABORT, held), and reports it as a security event.
    The direct-write transports (host, ipc, posix-fd, fabric) cannot refuse anything: P
    writes D's mapped memory itself, so who can map that memory is their boundary."""

    mode: str
    _grants: WriteGrants | None = None

    @property
    def grants(self) -> WriteGrants:
        if self._grants is None:
            self._grants = WriteGrants()
        return self._grants

    @grants.setter
    def grants(self, shared: WriteGrants) -> None:
        """Several receivers over one pool (`auto`'s parts) check the same grants."""
        self._grants = shared

    def grant(self, request_id: int, dst_slots: np.ndarray, deadline_unix_ms: int) -> bytes:
        """At RESERVE: the write capability of this reservation (module docstring).
        A receiver whose writes go through a third party (the proxy) also tells it."""
        return self.grants.grant(request_id, dst_slots, deadline_unix_ms)

    def revoke(self, request_id: int) -> None:
        """At COMMIT, ABORT or when the pages go held: no write of it is applied any more
        by a receiver that checks capabilities."""
        self.grants.revoke(request_id)

    @property
    @abc.abstractmethod
    def storage(self) -> torch.Tensor:
        """The pool tensor `[n_layers, 2, n_slots, n_kv_heads, head_dim]`."""

    @abc.abstractmethod
    def descriptors(self) -> list[Descriptor]:
        """What P needs to attach, best first."""

    def receiver_quiesced(self, request_id: int) -> bool:
        """Proof (c) of PROTOCOL.md: True when the receiver itself guarantees that no
        later write for this request is applied (TCP v3's receiver state). Transports
        where the sender writes into D's memory directly return False."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the storage and any handles."""


class KVSender(abc.ABC):
    """P's side: writes rows of P's pool into D's pool.

    Quiesce (PROTOCOL.md 3.5): `quiesce(request_id)` is the batch-quiesce proof. It
    returns True only when every write of that request has completed or can no longer be
    applied, and guarantees that no write for it starts afterwards. P answers ABORT_ACK
    only on True."""

    mode: str

    @abc.abstractmethod
    def write(
        self,
        request_id: int,
        src: torch.Tensor,
        src_slots: np.ndarray,
        dst_slots: np.ndarray,
        deadline_unix_ms: int,
        *,
        capability: bytes,
    ) -> None:
        """Copy every layer's K and V rows `src[:, :, src_slots] -> dst[:, :, dst_slots]`.

        `capability` is the reservation's write capability (ReserveReply.capability,
        the module docstring): a transport through which another process writes D's
        memory (tcp, proxy) presents it with every write, and D refuses a write without
        it; one where P writes D's mapped memory itself (host, ipc, posix-fd, fabric)
        carries it unused (who may map D's memory is the boundary there).

        Blocks until the rows are in D's memory (or raises TransferError). Must refuse to
        start when the request was cancelled (see `quiesce`). Raises TransferError on a
        passed deadline before starting. On CUDA the rows must have been written by work
        ordered before the caller's current stream: a sender orders itself after that
        stream (or synchronizes it), never the whole device, so a write runs beside work
        on other streams (P's next forward).
        """

    @abc.abstractmethod
    def quiesce(self, request_id: int) -> bool:
        """Cancel future writes of `request_id`; True iff none is in flight any more."""

    def in_flight(self) -> list[int]:
        """Request ids with a write in progress (drain checks by request id)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Detach from the receiver."""


class WriteGate:
    """A sender's side of quiesce (the module docstring): which requests have a write in
    flight, and which were quiesced, so that no write of theirs starts afterwards. The
    quiesced ids are remembered up to `memory` of the latest (a quiesce comes within a
    request's transfer deadline of its writes, so the oldest are long settled).

    `enter` and `quiesce` take one lock: a write either entered before the quiesce (and
    the quiesce answers False until it leaves) or is refused. A sender with steps of its
    own (chunks, connections) calls `check` between them to stop a quiesced write early."""

    def __init__(self, memory: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._memory = memory
        self._in_flight: dict[int, int] = {}
        self._quiesced: OrderedDict[int, None] = OrderedDict()

    @contextmanager
    def writing(self, request_id: int, deadline_unix_ms: int) -> Iterator[None]:
        """Around one write: refused (TransferError) when the request was quiesced or its
        deadline passed; counted in flight until it ends, whichever way."""
        with self._lock:
            self._refuse_if_stopped(request_id, deadline_unix_ms, "write refused")
            self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._in_flight[request_id] - 1
                if left:
                    self._in_flight[request_id] = left
                else:
                    del self._in_flight[request_id]

    def check(self, request_id: int, deadline_unix_ms: int, what: str) -> None:
        """Inside a write, between its steps: raises when it must stop (`what` says where)."""
        with self._lock:
            self._refuse_if_stopped(request_id, deadline_unix_ms, what)

    def quiesced(self, request_id: int) -> bool:
        return request_id in self._quiesced

    def quiesce(self, request_id: int) -> bool:
        """KVSender.quiesce: no write of `request_id` starts from now on; True iff none is
        in flight."""
        with self._lock:
            self._quiesced[request_id] = None
            self._quiesced.move_to_end(request_id)
            while len(self._quiesced) > self._memory:
                self._quiesced.popitem(last=False)
            return request_id not in self._in_flight

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._in_flight)

    def _refuse_if_stopped(self, request_id: int, deadline_unix_ms: int, what: str) -> None:
        if request_id in self._quiesced:
            raise TransferError(f"request {request_id} was cancelled (quiesced): {what}")
        late_ms = time.time() * 1000.0 - deadline_unix_ms
        if late_ms > 0:
            raise TransferError(f"request {request_id}: transfer deadline passed {late_ms:.0f} ms ago: {what}")
