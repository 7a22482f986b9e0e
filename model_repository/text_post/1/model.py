"""text_pipeline's last step: EMBEDDING (FP32 [batch, 384]) -> EMBEDDING_FP16, TOP_DIM (INT32 [batch, 1])."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            emb = pb_utils.get_input_tensor_by_name(request, "EMBEDDING").as_numpy()
            top = np.abs(emb).argmax(axis=1).astype(np.int32).reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING_FP16", emb.astype(np.float16)),
                                                         pb_utils.Tensor("TOP_DIM", top)]))
        return responses
