"""Misbehaves on purpose, per request, chosen by the request's IN value:

    -1 raise            -2 no response for it (too few)   -3 two responses for it (too many)
    -4 FP64 output      -5 output of the wrong shape      -6 segfault (kills the instance)
    -7 a str instead of an InferenceResponse
    anything else: OUT = IN
"""

import ctypes

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            v = int(x.reshape(-1)[0])
            if v == -1:
                raise ValueError("the model raised on purpose")
            if v == -2:
                continue
            if v == -3:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            if v == -4:
                x = x.astype(np.float64) + 0.5
            if v == -5:
                x = np.zeros((x.shape[0], 3), dtype=np.int32)
            if v == -6:
                ctypes.string_at(0)  # a real segfault: SIGSEGV in this instance's process
            if v == -7:
                out.append("not a response")
                continue
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
