"""Generated KServe v2 gRPC stubs (``grpc_service.proto``); regenerate with ``scripts/gen_proto.sh``."""
