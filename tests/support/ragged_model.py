"""A Python-backend test model for ragged batching (copied into a temporary repository as
<name>/1/model.py). Config: IN (FP32 [-1], allow_ragged_batch) and the batch input INDEX
(BATCH_ACCUMULATED_ELEMENT_COUNT of IN). Each request gets OUT = [start, end, requests in this
execute(), sum of its own elements] (one row per row of IN), where [start, end) are its elements in the
batch's concatenation of IN: end is its INDEX, start the INDEX of the request before it. The model also
checks that the offsets find the request's own elements in the concatenation."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        flat = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(-1) for r in requests]
        ends = np.concatenate([pb_utils.get_input_tensor_by_name(r, "INDEX").as_numpy() for r in requests])
        batch = np.concatenate(flat)
        responses = []
        for i, request in enumerate(requests):
            start, end = (int(ends[i - 1]) if i else 0), int(ends[i])
            if not np.array_equal(batch[start:end], flat[i]):
                raise ValueError(f"request {i}: offsets [{start}, {end}) do not hold its elements")
            rows = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().shape[0]
            out = np.tile(np.array([start, end, len(requests), flat[i].sum()], np.float32), (rows, 1))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
