"""A Python-backend test model (copied into a temporary repository as <name>/1/model.py) that shows when,
where and in what order requests ran. Each execution sleeps for the largest first element of IN among
its requests, in milliseconds, then answers every request with OUT = IN and, each as one INT64:
PID (the stub process that ran it), START_NS and END_NS (the execution's CLOCK_MONOTONIC interval, one
clock for every process of the machine), POSITION (the request's index within the execution)."""

import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(name, value, shape):
    return pb_utils.Tensor(name, np.full(shape, value, dtype=np.int64))


class TritonPythonModel:
    def execute(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        start = time.monotonic_ns()
        time.sleep(max(float(x.reshape(-1)[0]) for x in inputs) / 1000)
        end = time.monotonic_ns()
        responses = []
        for position, x in enumerate(inputs):
            shape = x.shape[:-1] + (1,)  # [1] without a batch dimension, [batch, 1] with one
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", x.astype(np.float32)), _scalar("PID", os.getpid(), shape),
                _scalar("START_NS", start, shape), _scalar("END_NS", end, shape),
                _scalar("POSITION", position, shape)]))
        return responses
