"""A Python-backend test model (copied into a temporary repository as <name>/1/model.py): OUT = IN, after
sleeping SLEEP_MS per execution, so requests queue behind it and queue policies can be observed."""

import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.sleep_s = float(config["parameters"]["SLEEP_MS"]["string_value"]) / 1000

    def execute(self, requests):
        time.sleep(self.sleep_s)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                             .as_numpy())]) for r in requests]
