"""Regenerate the committed gRPC stubs from kvmesh.proto: `python -m kvmesh.proto.generate`.

The stubs import each other as `kvmesh.proto.kvmesh_pb2`, so they work from any directory.
"""

import os
import sys
import tempfile

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))
PROTO_FILE = "kvmesh.proto"
STUBS = ("kvmesh_pb2.py", "kvmesh_pb2_grpc.py")


def generate(out_dir: str) -> list[str]:
    """Write the stubs into out_dir; returns their paths."""
    from grpc_tools import protoc  # grpcio-tools: a test / build dependency only

    # Compiled as kvmesh/proto/kvmesh.proto from the folder above kvmesh/, so the messages'
    # module is kvmesh.proto.kvmesh_pb2 (pickle finds them by that name inside Ray Serve).
    root = os.path.dirname(os.path.dirname(PROTO_DIR))
    rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"--python_out={out_dir}",
                      f"--grpc_python_out={out_dir}", os.path.join("kvmesh", "proto", PROTO_FILE)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [os.path.join(out_dir, "kvmesh", "proto", s) for s in STUBS]


def generated_texts() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as d:
        return {os.path.basename(p): open(p).read() for p in generate(d)}


if __name__ == "__main__":
    for name, text in generated_texts().items():
        with open(os.path.join(PROTO_DIR, name), "w") as f:
            f.write(text)
        print(f"wrote {os.path.join(PROTO_DIR, name)}", file=sys.stderr)
