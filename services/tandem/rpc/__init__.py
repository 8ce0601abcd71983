"""gRPC services and clients for the contracts in `protos/tandem/v1`.

- `inference_server`: the public `Inference` service over an `engine_loop.EngineLoop`.
- `experts_server` / `experts_client`: the internal `Experts` service and the
  `GrpcExpertExecutor` the attention process computes routed experts with.
- `server.serve`: one process of `tandem serve` (roles all, attention, experts), with health,
  reflection, `/metrics` and graceful shutdown.

Importing this package imports neither torch nor the engine; the modules do.
"""
