"""Per-job stage timing of the proxy's Copy path.

Owns the names of the stages a copy job passes through (`STAGES`) and the clock that
charges elapsed time to them, so the per-job overhead around the kernel is visible per
stage (`pdunit_proxy_job_stage_seconds{stage}` and CopyReply.stage_seconds). Must never
decide anything: it only measures.
"""

from __future__ import annotations

import time

# recv      caller's send stamp -> handler start (client serialisation, gRPC, dispatch)
# validate  session check, region lookup, bounds/duplicate checks, deadline
# admit     quiesce bookkeeping (JobTracker.start)
# map       mapping-cache lookups (a first-time map of a region is charged here)
# upload    slot arrays -> pinned buffer -> device (async, on the job's stream)
# launch    kernel enqueue(s)
# sync      waiting for the copy to finish (the device time, mostly)
# copy      host backend: the reference copy itself
# checksum  verify=true only
# reply     building the reply and the metrics
STAGES = ("recv", "validate", "admit", "map", "upload", "launch", "sync", "copy", "checksum", "reply")


class StageClock:
    """Charges the time since the previous mark to the named stage."""

    __slots__ = ("last", "seconds")

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, stage: str) -> float:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + (now - self.last)
        self.last = now
        return now
