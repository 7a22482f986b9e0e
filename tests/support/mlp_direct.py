"""model_repository/mlp run in the test's own process: what every served `mlp` answer must equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MLP = Path(__file__).resolve().parents[2] / "model_repository" / "mlp" / "1" / "model.pt"


def mlp_direct(x: np.ndarray) -> np.ndarray:
    import warnings

    import torch

    with warnings.catch_warnings():  # TorchScript is what Triton's pytorch_libtorch backend loads
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.load(str(MLP)).eval()
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]
