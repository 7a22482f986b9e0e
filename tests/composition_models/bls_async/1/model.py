"""BLS, asynchronous: two calls in flight at once from an `async def execute`."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                      pb_utils.get_input_tensor_by_name(request, "INPUT1")]
            calls = [pb_utils.InferenceRequest(model_name=name, requested_output_names=["OUTPUT0", "OUTPUT1"],
                                               inputs=inputs).async_exec()
                     for name in ("torch_add_sub", "add_sub")]
            replies = await asyncio.gather(*calls)
            for reply in replies:
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(replies[0], "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(replies[1], "OUTPUT1"),
            ]))
        return responses
