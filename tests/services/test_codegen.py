"""The committed stubs are what the pinned codegen makes from the protos."""

from __future__ import annotations

import shutil

from tandem.rpc import codegen


def test_committed_stubs_are_up_to_date():
    stale = codegen.stale(codegen.generate())
    assert stale == [], f"stale gRPC stubs {stale}: run `python -m tandem.rpc.codegen` (make protos)"


def test_check_notices_an_edited_proto(tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(codegen.PROTO_ROOT, protos)
    proto = protos / "tandem" / "v1" / "inference.proto"
    proto.write_text(proto.read_text().replace("string text = 1;", "string text = 1;\n  bool lower = 99;", 1))
    assert "inference_pb2.py" in codegen.stale(codegen.generate(protos))


def test_check_notices_an_extra_stub(tmp_path):
    gen = tmp_path / "gen"
    shutil.copytree(codegen.GEN_DIR, gen)
    (gen / "old_pb2.py").write_text("# left over from a removed proto\n")
    assert codegen.stale(codegen.generate(), gen) == ["old_pb2.py"]


def test_stubs_import_from_the_package_and_keep_wire_names():
    from tandem.rpc.gen import inference_pb2

    assert inference_pb2.DESCRIPTOR.package == "tandem.v1"
    assert inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name == "tandem.v1.Inference"
    assert "from tandem.rpc.gen import experts_pb2" in (codegen.GEN_DIR / "experts_pb2_grpc.py").read_text()
