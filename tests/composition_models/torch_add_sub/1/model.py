"""OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, with torch (through DLPack both ways)."""

import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT0").to_dlpack())
            b = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT1").to_dlpack())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor.from_dlpack("OUTPUT0", torch.to_dlpack(a + b)),
                pb_utils.Tensor.from_dlpack("OUTPUT1", torch.to_dlpack(a - b)),
            ]))
        return responses
