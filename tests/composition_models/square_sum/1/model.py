"""SUM = the sum of OUT over every response 'square' sends for IN (n responses of n: n squared)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="square", requested_output_names=["OUT"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
            total = np.array([0], np.int32)
            for reply in call.exec(decoupled=True):
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
                total += pb_utils.get_output_tensor_by_name(reply, "OUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return responses
