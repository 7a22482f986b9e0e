import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            # Triton allows str/int/bool response parameters: floats come back as strings.
            params = {k: str(v) if isinstance(v, float) else v for k, v in json.loads(r.parameters()).items()}
            x = pb_utils.get_input_tensor_by_name(r, "IN")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x.as_numpy())], parameters=params))
        return out
