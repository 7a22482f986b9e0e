"""Every kind of pb_utils custom metric, with the model/version labels a Triton user passes: a counter
of requests, a gauge each instance sets to 1 (the fleet's sum: instances running), and a histogram of
the values of IN's first element."""

import time

import triton_python_backend_utils as pb_utils

BUCKETS = [1.0, 2.0, 4.0]


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.requests = pb_utils.MetricFamily(
            "probe_requests", "Requests this model executed", pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
        self.instances = pb_utils.MetricFamily(
            "probe_instances", "Instances of this model running", pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
        self.values = pb_utils.MetricFamily(
            "probe_values", "IN[0] of each request", pb_utils.MetricFamily.HISTOGRAM).Metric(
                labels=labels, buckets=BUCKETS)
        self.instances.set(1)

    def execute(self, requests):
        time.sleep(0.05)
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            self.values.observe(float(data[0]))
            self.requests.increment(1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data)]))
        return responses
