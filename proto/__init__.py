"""gRPC API of rankserve (`rankserve.proto`); the Python stubs are generated here on first import.

`rankserve_pb2.py` / `rankserve_pb2_grpc.py` are build outputs (ignored by git). They are compiled with grpc_tools
from a temporary include root laid out as `rankserve/proto/rankserve.proto`, so the generated gRPC module imports
its sibling as `from rankserve.proto import rankserve_pb2` instead of the flat `import rankserve_pb2`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "rankserve.proto"
STUBS = (HERE / "rankserve_pb2.py", HERE / "rankserve_pb2_grpc.py")


def generate(force: bool = False) -> None:
    """(Re)compile the stubs next to the .proto when missing or older than it."""
    if not force and all(s.exists() and s.stat().st_mtime >= PROTO.stat().st_mtime for s in STUBS):
        return
    from grpc_tools import protoc  # only needed to build; the stubs themselves need grpcio + protobuf

    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "rankserve" / "proto"
        pkg.mkdir(parents=True)
        shutil.copy(PROTO, pkg / PROTO.name)
        include = Path(protoc.__file__).parent / "_proto"  # well-known types
        rc = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"-I{include}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}", f"rankserve/proto/{PROTO.name}"])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {PROTO}")
        for stub in STUBS:
            part = HERE / f".{stub.name}.{os.getpid()}"  # other processes may import concurrently: replace atomically
            shutil.copy(pkg / stub.name, part)
            os.replace(part, stub)


generate()
