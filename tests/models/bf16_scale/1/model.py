"""3 * IN computed in float32 (fleet hands a BF16 input to the model widened to float32), returned as
BF16 two ways: OUT_CAST as a plain float32 array, which the worker casts to the declared BF16, and
OUT_TAGGED as a float32 array the model itself tags BF16 (pb_utils.Tensor's triton_dtype), which the stub
encodes. Either way the float32 result must be rounded to BF16 to nearest even, not truncated."""

import numpy as np
import triton_python_backend_utils as pb_utils

TYPE_BF16 = 14  # TRITONSERVER_TYPE_BF16


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            y = x.astype(np.float32) * np.float32(3)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT_CAST", y),
                pb_utils.Tensor("OUT_TAGGED", y, triton_dtype=TYPE_BF16)]))
        return responses
