"""Regenerates operator/proto/externalscaler_pb2*.py from externalscaler.proto.

Run `python -m pdunit.operator.proto.build`. The generated files are committed so that
nothing at run time needs protoc; tests/operator/test_scaler.py fails when they are
stale. Reuses engine/proto/build.py's `generate` so both protos build the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    from pdunit.engine.proto.build import generate

    for path in generate(HERE, HERE):
        print(f"wrote {path.relative_to(HERE.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
