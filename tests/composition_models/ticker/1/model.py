"""Counts to N with a response per tick, in execute(); notices cancellation between ticks."""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.cancel_log = json.loads(args["model_config"])["parameters"]["CANCEL_LOG"]["string_value"]

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY_MS")
            delay_s = 0.0 if delay is None else int(delay.as_numpy()[0]) / 1000
            sender = request.get_response_sender()
            for i in range(n):
                if request.is_cancelled():
                    if self.cancel_log:
                        with open(self.cancel_log, "a") as log:
                            log.write(f"{request.request_id()} at {i}\n")
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    break
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == n - 1 else 0
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TICK", np.array([i], np.int32))]),
                            flags=flags)
                time.sleep(delay_s)
            if n <= 0:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
