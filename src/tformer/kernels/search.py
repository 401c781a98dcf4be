"""Beam search's candidates: the best k of log_softmax(logits) + a score, row by row.

With torch this is a log-softmax into a fresh (N, V) tensor, an addition over it and a
top-k: at beam 4 and batch 16 over OPUS-MT's 58,101 tokens, three passes over 15 MB and a
15 MB allocation a step. `search.c` picks the best k of the logits themselves (a row's
log-softmax keeps its order) while it finds their maximum, sums the exponentials in a second
pass, and computes the log-probabilities of the k it keeps only. Where the kernel is not
built, torch computes the same numbers.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.kernels import library


def check(lib: ctypes.CDLL) -> bool:
    """The same for search.c: beam search's candidates as torch's log-softmax and top-k
    choose them, a vector's worth of columns and a remainder, two of them banned."""
    x, add, banned = torch.randn(3, 37), torch.randn(3), torch.tensor([0, 4])
    top, index = x.new_empty(3, 5), torch.empty(3, 5, dtype=torch.long)
    lib.tformer_top_logprobs(x.data_ptr(), add.data_ptr(), banned.data_ptr(), len(banned),
                             top.data_ptr(), index.data_ptr(), 3, 37, 5, 1)
    logprobs = F.log_softmax(x, dim=-1).index_fill_(1, banned, float("-inf"))
    want, want_index = logprobs.add_(add[:, None]).topk(5, dim=-1)
    return torch.equal(index, want_index) and torch.allclose(top, want, atol=1e-5)


def native() -> ctypes.CDLL | None:
    """The kernels' library, where this module's kernels passed their check; else None."""
    return library.checked(check)


def top_logprobs(
    logits: Tensor, add: Tensor, k: int, banned: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The best k of log_softmax(logits) + add[:, None] in each row, best first, with the
    columns in `banned` set to -inf after the log-softmax (which is over all columns).

    logits: (N, V); add: (N,); banned: (B,) int64 column ids or None; 1 <= k <= V.
    Returns the values (N, k) and their columns (N, k). Equal values come in the order of
    their columns from the kernel (torch.topk does not promise an order for them). The kernel
    sums the exponentials in another order than torch, so the values can differ from
    torch's in the last bits.
    """
    n, v = logits.shape
    banned = logits.new_empty(0, dtype=torch.long) if banned is None else banned
    if not 1 <= k <= v:
        raise ValueError(f"top_logprobs: k = {k} for rows of {v}")
    lib = native()
    if lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return torch_top_logprobs(logits, add, k, banned)
    logits, add = logits.contiguous(), add.to(torch.float32).contiguous()
    banned = banned.to(torch.long).contiguous()
    top = logits.new_empty(n, k)
    index = torch.empty(n, k, dtype=torch.long)
    lib.tformer_top_logprobs(logits.data_ptr(), add.data_ptr(), banned.data_ptr(), len(banned),
                             top.data_ptr(), index.data_ptr(), n, v, k, torch.get_num_threads())
    return top, index


def torch_top_logprobs(
    logits: Tensor, add: Tensor, k: int, banned: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """top_logprobs through torch alone (what it computes where there is no kernel)."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    if banned is not None:
        logprobs.index_fill_(1, banned, float("-inf"))
    return logprobs.add_(add[:, None]).topk(k, dim=-1)
