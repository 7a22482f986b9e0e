"""A TorchScript test model for ragged batching (tests/integration/test_ragged.py): IN arrives as one 1-D
tensor of every request's elements, OFFSETS (BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO) says where each
request's elements are. SUM = one sum per request; TWICE = the whole input doubled, for a batch_output to
scatter back by each request's input shape. Imports torch: import it only where torch is installed."""

from typing import Tuple  # noqa: UP035  (TorchScript resolves typing.Tuple in signatures)

import torch


class RaggedModel(torch.nn.Module):
    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
        sums = [x[int(offsets[i]):int(offsets[i + 1])].sum().reshape(1) for i in range(offsets.shape[0] - 1)]
        return torch.stack(sums), x * 2
