import numpy as np
import triton_python_backend_utils as pb_utils

ORDINARY = [1.5, -2.0, 0.25, 3.0]
NON_FINITE = [float("nan"), float("inf"), float("-inf"), 1.5]
TEXT = [b"plain", "é".encode(), b""]
NOT_UTF8 = [b"ok", b"\xff\xfe\x00", b"\xc3("]


class TritonPythonModel:
    def execute(self, requests):
        return [self._one(int(pb_utils.get_input_tensor_by_name(r, "CASE").as_numpy()[0])) for r in requests]

    def _one(self, case):
        if case == 3:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError("CASE 3 is refused on purpose", pb_utils.TritonError.INVALID_ARG))
        floats = NON_FINITE if case == 1 else ORDINARY
        text = NOT_UTF8 if case == 2 else TEXT
        outputs = [pb_utils.Tensor("F16", np.array(floats, np.float16)),
                   pb_utils.Tensor("F32", np.array(floats, np.float32)),
                   pb_utils.Tensor("F64", np.array(floats, np.float64)),
                   pb_utils.Tensor("BF", np.array(floats, np.float32)),
                   pb_utils.Tensor("TXT", np.array(text, dtype=object))]
        # Parameters as a JSON string are taken as they are: Python's json reads NaN into them.
        params = '{"score": NaN}' if case == 4 else {}
        return pb_utils.InferenceResponse(outputs, parameters=params)
