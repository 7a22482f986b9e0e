"""The RPCs of inference.GRPCInferenceService that fleet serves, over the gateway's own state.

Each method takes the parsed request message and the call's context and returns the response message;
errors are ServingErrors, turned into gRPC statuses in one place (gateway/grpc/handlers.py, with
gateway/errors.py's table). What the health, metadata and repository RPCs answer comes from
gateway/model_info.py, which the HTTP routes render too; ModelInfer decodes into the ParsedInfer HTTP's
parser produces (codec.py) and then takes the one data path (gateway/dataplane.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from google.protobuf import json_format

from fleet import log_context
from fleet.errors import (
    DeadlineExceeded,
    ErrorCode,
    ServingError,
    Unsupported,
)
from fleet.trace_points import (
    GRPC_SEND_END,
    GRPC_SEND_START,
    GRPC_WAITREAD_END,
    GRPC_WAITREAD_START,
    REQUEST_END,
    REQUEST_START,
)
from gateway import model_info
from gateway.grpc import settings_rpcs, shm_rpcs
from gateway.grpc.codec import encode_infer, request_version
from gateway.grpc.request_heads import RequestHeads
from gateway.grpc.response_heads import ResponseHeads
from gateway.grpc.service_proto import service_pb2 as pb
from gateway.grpc.stream import StreamAnswer, StreamSessions
from gateway.routes import EXTENSIONS, SERVER_VERSION
from gateway.state import GatewayState
from gateway.tracer import Trace


class InferenceService:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.streams = StreamSessions(self.infer_stream, state.dataplane)
        self.heads = RequestHeads()  # ModelInferRequests decoded once per head (gateway/grpc/request_heads.py)
        self.responses = ResponseHeads()  # and their responses serialized from one (gateway/grpc/response_heads.py)

    def drain(self) -> None:
        """The server is stopping: open streams read no more requests and end once theirs are answered."""
        self.streams.drain()

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        reason = await model_info.not_ready_reason(self.state.catalog, self.state.broker)
        return pb.ServerReadyResponse(ready=reason is None)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        # As tritonserver: an unknown model or version is not ready (no error); a version that is not a
        # number is one.
        return pb.ModelReadyResponse(ready=self.state.catalog.is_ready(request.name, request_version(request.version)))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name="triton", version=SERVER_VERSION, extensions=EXTENSIONS)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        doc = model_info.model_metadata(self.state.catalog, request.name, request_version(request.version))
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=doc["name"], versions=doc["versions"], platform=doc["platform"],
            inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in doc["inputs"]],
            outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in doc["outputs"]],
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        # The normalised config HTTP's /config renders as JSON (fleet/config_json.py), as the message.
        view = model_info.model_view(self.state.catalog, request.name, request_version(request.version))
        return pb.ModelConfigResponse(config=view.entry.spec.proto)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        name = request.name or None
        doc = await self.state.statistics(name, request_version(request.version) if name else None)
        # Fields of fleet's own (a generative model's "generation") have no place in Triton's message.
        return json_format.ParseDict(doc, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        if request.repository_name:
            raise Unsupported("naming a model repository is not supported: fleet serves its repositories as one")
        await self.state.control.rescan_for_index()
        items = model_info.repository_index(self.state.catalog, request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**item) for item in items])

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        if request.repository_name:
            raise Unsupported("naming a model repository is not supported: fleet serves its repositories as one")
        await self.state.control.load(request.model_name, _repository_parameters(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        if request.repository_name:
            raise Unsupported("naming a model repository is not supported: fleet serves its repositories as one")
        await self.state.control.unload(request.model_name, _repository_parameters(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        dataplane = self.state.dataplane
        # The trace extension: a request not traced pays this one attribute read (gateway/tracer.py). The
        # message has been read when the handler runs, so both read stamps are taken now; the send stamps
        # as the response goes to the connection (it is written in the same loop turn).
        tracer = self.state.tracer
        trace = tracer.sample(request.model_name, GRPC_WAITREAD_START) if tracer.active else None
        if trace is not None:
            trace.stamp(GRPC_WAITREAD_END)
        try:
            dataplane.admit()  # Overloaded past max_in_flight, counted with the HTTP requests
        except ServingError:
            if trace is not None:
                trace.finish()
            raise
        try:
            return await self.infer(request, context.time_remaining(), trace, serialized=True)
        except ServingError as exc:
            # The request's expiry is the caller's deadline, so a worker or the gateway may answer
            # "Request timeout expired" just as the deadline passes: the caller's own deadline is the
            # cause, and tritonclient expects DEADLINE_EXCEEDED for it.
            # (50 ms: the expiry is judged on Redis's clock, estimated to within a few ms.)
            remaining = context.time_remaining()
            if remaining is not None and remaining < 0.05 and exc.code == ErrorCode.UNAVAILABLE:
                raise DeadlineExceeded("Deadline Exceeded") from exc
            raise
        finally:
            dataplane.release()
            if trace is not None:
                trace.stamp(GRPC_SEND_START)
                trace.stamp(GRPC_SEND_END)
                trace.finish()

    def ModelStreamInfer(self, requests: AsyncIterator[bytes], context: Any) -> AsyncGenerator[bytes, None]:
        return self.streams.serve(requests, context)

    # Shared memory: the registry HTTP's routes use (gateway/shared_memory.py), through gateway/grpc/shm_rpcs.py.

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        return shm_rpcs.system_status(self.state.shared_memory, request)

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        return shm_rpcs.system_register(self.state.shared_memory, request)

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        return shm_rpcs.system_unregister(self.state.shared_memory, request)

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        return shm_rpcs.cuda_status(self.state.shared_memory, request)

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        return shm_rpcs.cuda_register(self.state.shared_memory, request)

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        return shm_rpcs.cuda_unregister(self.state.shared_memory, request)

    # The logging and trace extensions: HTTP's functions (gateway/runtime_settings.py), via settings_rpcs.py.

    async def LogSettings(self, request: Any, context: Any) -> Any:
        return await settings_rpcs.log_settings(self.state.runtime, request)

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        return await settings_rpcs.trace_setting(self.state.runtime, request)

    async def infer(self, request: Any, timeout_s: float | None, trace: Trace | None = None, *,
                    serialized: bool = False) -> Any:
        """One ModelInferRequest through the data path; `timeout_s`: how long its caller still waits. Its
        ModelInferResponse, or (`serialized`) the response's bytes, from a known head where one makes them
        (gateway/grpc/response_heads.py)."""
        catalog, dataplane = self.state.catalog, self.state.dataplane
        # Not unbound: each request is a task of its own (calls.py, stream.py), whose failure line, logged
        # after this returns, names the request too.
        log_context.bind(log_context.RequestLog(request.model_name, request.model_version))
        if trace is not None:
            trace.stamp(REQUEST_START)
        view, v = catalog.resolve(request.model_name, request_version(request.model_version))
        spec = view.entry.spec
        req = self.heads.decode(request, spec, dataplane.regions)
        reply = await dataplane.run(request.model_name, v, spec, req, trace, caller_timeout_s=timeout_s)
        response: Any = None
        if serialized:
            response = self.responses.serialize(request.model_name, v, req, reply.outputs or [], reply.parameters)
        if response is None:
            response = encode_infer(request.model_name, v, req, reply.outputs or [], reply.parameters)
        if trace is not None:
            trace.stamp(REQUEST_END)
        return response


    async def infer_stream(self, request: Any, timeout_s: float | None) -> AsyncGenerator[StreamAnswer, None]:
        """One ModelInferRequest of a stream: its one response, or each of a decoupled model's as it comes,
        every one marked `triton_final_response` (true on the last), as tritonserver 2.51 marks them. With
        the request parameter `triton_enable_empty_final_response` (Triton's), a final flag the model sent
        alone is an empty response marked final; without it, that flag sends nothing."""
        flag = request.parameters.get(EMPTY_FINAL)
        empty_final = flag is not None and flag.WhichOneof("parameter_choice") == "bool_param" and flag.bool_param
        if flag is not None:
            del request.parameters[EMPTY_FINAL]
        catalog, dataplane = self.state.catalog, self.state.dataplane
        log_context.bind(log_context.RequestLog(request.model_name, request.model_version))  # as in infer
        view, v = catalog.resolve(request.model_name, request_version(request.model_version))
        spec = view.entry.spec
        if not spec.decoupled:
            # tritonserver 2.51 marks a non-decoupled model's one stream response final, flag or not.
            yield StreamAnswer(_marked(await self.infer(request, timeout_s), True), None, True)
            return
        # A decoupled model's answers go as they come: the requests after it on the stream need not wait for
        # its first (gateway/grpc/stream.py).
        yield StreamAnswer(None, None, False, in_order=False)
        req = self.heads.decode(request, spec, dataplane.regions)
        async for reply in dataplane.responses(request.model_name, v, spec, req, caller_timeout_s=timeout_s):
            if not reply.ok:
                yield StreamAnswer(None, reply.error_message, reply.final, in_order=False)
            elif reply.empty:
                response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(v), id=req.client_id)
                yield StreamAnswer(_marked(response, True) if empty_final else None, None, True, in_order=False)
            else:
                response = encode_infer(request.model_name, v, req, reply.outputs or [], reply.parameters)
                yield StreamAnswer(_marked(response, reply.final), None, reply.final, in_order=False)


EMPTY_FINAL = "triton_enable_empty_final_response"


def _marked(response: Any, final: bool) -> Any:
    response.parameters["triton_final_response"].bool_param = final
    return response


def _repository_parameters(parameters: Any) -> dict[str, Any]:
    """ModelRepositoryParameter values as the HTTP body's JSON values (a `file:` override as bytes)."""
    out: dict[str, Any] = {}
    for key, param in parameters.items():
        which = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, which) if which else None
    return out
