"""The timestamps a traced request collects on its way, named as Triton names its own (docs/user_guide/
trace.md) where Triton has the hop, `FLEET_*` where the hop is fleet's (Redis in between).

Every timestamp is ns on Redis's clock (fleet/redis_time.py), so the gateway's and the worker's stamps of
one request line up whatever the skew between their hosts. `ORDER` is the order the hops happen in; a
trace file lists each trace's timestamps in this order.
"""

from __future__ import annotations

HTTP_RECV_START = "HTTP_RECV_START"  # the gateway took the request (headers read)
HTTP_RECV_END = "HTTP_RECV_END"  # ... and its body
GRPC_WAITREAD_START = "GRPC_WAITREAD_START"
GRPC_WAITREAD_END = "GRPC_WAITREAD_END"
REQUEST_START = "REQUEST_START"  # the data plane starts on it (resolve, parse, validate)
QUEUE_START = "QUEUE_START"  # handed to the broker for XADD onto its lane
WORKER_READ = "FLEET_WORKER_READ"  # a worker read it (XREADGROUP or a claim) and admitted it
BATCH_FORMED = "FLEET_BATCH_FORMED"  # the scheduler put it in a batch for an instance: its queue ends
COMPUTE_START = "COMPUTE_START"  # the instance started the batch (decoding inputs)
COMPUTE_INPUT_END = "COMPUTE_INPUT_END"
COMPUTE_OUTPUT_START = "COMPUTE_OUTPUT_START"
COMPUTE_END = "COMPUTE_END"  # outputs encoded
REPLY_WRITE = "FLEET_REPLY_WRITE"  # the worker sends the reply (XADD onto the gateway's reply stream)
REPLY_RECEIVED = "FLEET_REPLY_RECEIVED"  # the gateway's reply reader got it
REQUEST_END = "REQUEST_END"  # the response body is rendered
HTTP_SEND_START = "HTTP_SEND_START"
HTTP_SEND_END = "HTTP_SEND_END"
GRPC_SEND_START = "GRPC_SEND_START"
GRPC_SEND_END = "GRPC_SEND_END"

ORDER: tuple[str, ...] = (
    HTTP_RECV_START, HTTP_RECV_END, GRPC_WAITREAD_START, GRPC_WAITREAD_END, REQUEST_START, QUEUE_START,
    WORKER_READ, BATCH_FORMED, COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END,
    REPLY_WRITE, REPLY_RECEIVED, REQUEST_END, HTTP_SEND_START, HTTP_SEND_END, GRPC_SEND_START, GRPC_SEND_END,
)
