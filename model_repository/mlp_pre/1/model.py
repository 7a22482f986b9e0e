"""mlp_pipeline's first step: RAW (FP32 [batch, 256]) -> INPUT0, each row standardised."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            mean = raw.mean(axis=1, keepdims=True)
            std = raw.std(axis=1, keepdims=True) + 1e-6
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("INPUT0", ((raw - mean) / std).astype(np.float32))]))
        return responses
