"""The committed gRPC stubs are exactly what protoc generates from kvmesh/proto/kvmesh.proto
(regenerate with `python -m kvmesh.proto.generate`)."""

import os
import re

from kvmesh.proto import generate


def _committed(name):
    with open(os.path.join(generate.PROTO_DIR, name)) as f:
        return f.read()


def _descriptor(pb2_text):
    # the serialized FileDescriptorProto: the .proto itself, whatever protoc version wrote it
    return re.search(r"AddSerializedFile\((b'.*?')\)", pb2_text, re.S).group(1)


def _without_versions(grpc_text):
    return re.sub(r"^GRPC_GENERATED_VERSION = .*$", "", grpc_text, flags=re.M)


def test_committed_stubs_match_the_proto():
    fresh = generate.generated_texts()
    assert _descriptor(_committed("kvmesh_pb2.py")) == _descriptor(fresh["kvmesh_pb2.py"]), \
        "kvmesh_pb2.py is stale: run python -m kvmesh.proto.generate"
    assert _without_versions(_committed("kvmesh_pb2_grpc.py")) == _without_versions(fresh["kvmesh_pb2_grpc.py"]), \
        "kvmesh_pb2_grpc.py is stale: run python -m kvmesh.proto.generate"


def test_messages_live_in_the_package_module_so_they_pickle():
    import pickle

    from kvmesh.proto import kvmesh_pb2 as pb

    assert pb.GenerateRequest.__module__ == "kvmesh.proto.kvmesh_pb2"
    req = pb.GenerateRequest(prompt="hi", max_tokens=3)
    assert pickle.loads(pickle.dumps(req)) == req


def test_service_has_the_four_rpcs():
    from kvmesh.proto import kvmesh_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "kvmesh.v1.Generation"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Abort", "Health", "ListModels"}
    assert methods["Generate"].server_streaming is True
