"""BLS, synchronous: forward INPUT0/INPUT1 to the model MODEL_NAME names and answer with its outputs."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            callee = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0].decode()
            call = pb_utils.InferenceRequest(
                model_name=callee,
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")],
            )
            reply = call.exec()
            if reply.has_error():
                raise pb_utils.TritonModelException(reply.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(reply, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(reply, "OUTPUT1"),
            ]))
        return responses
