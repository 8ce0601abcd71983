"""Generated gRPC stubs; see tandem.rpc.codegen."""
