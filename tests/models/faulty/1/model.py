import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x[0] < -100:
                os._exit(3)  # a crashing model: costs this instance's batch, not the worker
            if x[0] < 0:
                raise ValueError("negative input")
            if x[0] == 0:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("zero is not allowed",
                                                                                 pb_utils.TritonError.INVALID_ARG)))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
