"""text_pipeline's first step: RAW_TEXT (BYTES [batch, 1]) -> TEXT, cleaned for the embedding model."""

import numpy as np
import triton_python_backend_utils as pb_utils

MAX_CHARS = 2000


def clean(raw):
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
    text = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(text.split())[:MAX_CHARS].encode("utf-8")


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW_TEXT").as_numpy()
            cleaned = np.array([[clean(v) for v in row] for row in raw], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", cleaned)]))
        return responses
