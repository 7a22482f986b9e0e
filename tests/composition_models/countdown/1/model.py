"""Counts N down by calling NEXT (from the config) with N - 1; answers how deep the calls went."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.next = json.loads(args["model_config"])["parameters"]["NEXT"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            if n <= 0:
                depth = 0
            else:
                reply = pb_utils.InferenceRequest(
                    model_name=self.next, requested_output_names=["DEPTH"],
                    inputs=[pb_utils.Tensor("N", np.array([n - 1], dtype=np.int32))]).exec()
                if reply.has_error():
                    responses.append(pb_utils.InferenceResponse(error=reply.error()))
                    continue
                depth = int(pb_utils.get_output_tensor_by_name(reply, "DEPTH").as_numpy()[0]) + 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("DEPTH", np.array([depth], np.int32))]))
        return responses
