"""Next-token choice. This build chooses greedily; sampling parameters arrive with the gRPC server."""
from __future__ import annotations

import torch

from engine.batch import NextTokenChooserParameters
from engine.errors import InvalidRequestError


def validate_parameters(request_id: int, params: NextTokenChooserParameters) -> None:
    if params.do_sample:
        raise InvalidRequestError(f"request {request_id}: do_sample is not supported yet (greedy decoding only)")


def choose_greedy(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """The most likely token of every row and its log-probability."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logits.argmax(dim=-1)
    return chosen.tolist(), logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
