"""Regenerates the Python modules of engine/proto/*.proto (`make proto`).

The generated *_pb2*.py files are committed so that nothing at run time needs protoc;
tests/test_packaging.py fails when they are stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent


def generate(proto_dir: Path, out_dir: Path) -> list[Path]:
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    written = []
    for proto in sorted(proto_dir.glob("*.proto")):
        rc = protoc.main([
            "protoc", f"-I{proto_dir}", f"-I{include}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            str(proto),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto}")
        stem = proto.stem
        grpc_file = out_dir / f"{stem}_pb2_grpc.py"
        # protoc writes absolute imports; the package needs relative ones.
        text = grpc_file.read_text()
        text = re.sub(rf"^import {stem}_pb2 as", f"from . import {stem}_pb2 as", text, flags=re.M)
        grpc_file.write_text(text)
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi", grpc_file]
    return written


def main(argv: list[str]) -> int:
    """Regenerates each folder given (default: this one) in place."""
    for folder in [Path(a).resolve() for a in argv] or [HERE]:
        for path in generate(folder, folder):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
