"""Sums each sequence's INPUTs twice over: through implicit state (OUTPUT) and in this instance's own
memory keyed by the correlation id (MEMO). BATCH is how many requests the execute() call held."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        self.memo = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(_scalar(request, "INPUT"))
            corrid = _scalar(request, "CORRID")
            corrid = corrid.decode() if isinstance(corrid, bytes) else str(corrid)
            start = int(_scalar(request, "START")) == 1
            state = 0 if start else int(_scalar(request, "INPUT_STATE"))
            total = state + value
            self.memo[corrid] = (0 if start else self.memo.get(corrid, -10_000)) + value
            if int(_scalar(request, "END")) == 1:
                self.memo.pop(corrid, None)
            out = np.array([[total]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", out),
                pb_utils.Tensor("OUTPUT_STATE", out),
                pb_utils.Tensor("MEMO", np.array([[self.memo.get(corrid, total)]], dtype=np.int32)),
                pb_utils.Tensor("BATCH", np.array([[len(requests)]], dtype=np.int32)),
            ]))
        return responses
