"""mlp_pipeline's last step: LOGITS (FP32 [batch, 256]) -> PROBS (softmax), CLASS (argmax, INT32 [batch, 1])."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
            top = logits.argmax(axis=1).astype(np.int32).reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PROBS", probs), pb_utils.Tensor("CLASS", top)]))
        return responses
