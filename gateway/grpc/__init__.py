"""Triton's gRPC protocol (`inference.GRPCInferenceService`, the messages of tritonclient.grpc's own
generated modules) served by the gateway process on the same event loop as HTTP, over the same state:

    server.py         the server: port, connections, keepalive, graceful stop (fleet's own, not grpc.aio)
    h2.py             one HTTP/2 connection without I/O, receiving: frames, settings, flow control, GOAWAY
    h2_send.py        ... and sending: headers, DATA within the peer's windows, trailers, resets, pings
    h2_frames.py      HTTP/2's wire vocabulary: frame types, flags, codes, settings, a stream's state
    h2_pings.py       gRPC's keepalive and ping-strike policy, on an injected clock
    header_codec.py   HPACK: the decoder (the `hpack` library's static table and Huffman code) and encodings
    calls.py          one call on a stream: messages, compression, deadline, status and trailers
    handlers.py       every RPC of the proto: auth, request parsing, ServingError -> status (gateway/errors.py)
    service.py        the RPCs: health, metadata, config, statistics, repository, ModelInfer, and the rest
    stream.py         ModelStreamInfer: many requests in flight on one stream, answered in the order they came
    codec.py          ModelInferRequest -> ParsedInfer (what HTTP's parser produces), reply -> ModelInferResponse
    shm_rpcs.py       the shared-memory RPCs over the registry HTTP uses (gateway/shared_memory.py)
    settings_rpcs.py  LogSettings and TraceSetting over what HTTP uses (gateway/runtime_settings.py)
    not_yet.py        RPCs not served (none today): THE place where one answers UNIMPLEMENTED until wired in
    service_proto.py  tritonclient's generated messages (service_pb2), loaded without its gRPC client
    status_codes.py   gRPC's status codes, grpcio's numbers without grpcio
"""
