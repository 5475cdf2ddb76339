"""Generated protobuf and gRPC code for the fedpca wire protocol, version 1.

Do not edit the ``*_pb2*`` modules by hand: change the ``.proto`` files next to
them and run ``scripts/gen_proto.sh`` (a test fails if they drift apart).
"""
