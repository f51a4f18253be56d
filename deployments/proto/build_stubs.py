"""Regenerate the Python gRPC stubs from moeserve/v1/generate.proto (run from the repo root).

    python deployments/proto/build_stubs.py [OUT_DIR]

The stubs' import is rewritten to `deployments.proto`, so the proto's own path never shadows `moeserve`.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
PROTO = "moeserve/v1/generate.proto"


def main(out_dir: Path = HERE) -> int:
    """Write the stubs into `out_dir` (default: next to this script); returns protoc's exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{HERE}", f"-I{include}",
            f"--python_out={tmp}", f"--grpc_python_out={tmp}", str(HERE / PROTO),
        ])  # fmt: skip
        if rc != 0:
            return rc
        out = Path(tmp) / "moeserve" / "v1"
        for name in ("generate_pb2.py", "generate_pb2_grpc.py"):
            text = (out / name).read_text()
            text = re.sub(r"^from moeserve\.v1 import", "from deployments.proto import", text, flags=re.M)
            (out_dir / name).write_text(text)
    print(f"wrote stubs for {PROTO} to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
