"""The rankers benchmarks/hybrid.py (at tag studies-2026-12-06) measured against the semantic
tier's fusion, and which lost there (so they are not in the library): reciprocal-rank fusion,
and a rerank by the archive's own LM, the query's likelihood after each candidate's context.

- RRF(BM25, MiniLM) hit@1 0.533 against the weighted min-max fusion's 0.637 (RESULTS.md,
  "Hybrid ranking").
- The LM rerank wins (+0.10 hit@1 on 40 queries) only in a prompt built for this set (the
  query placed where a docstring goes); in forms a library could use for any text it loses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rrf(
    rankings: Sequence[np.ndarray], k: float = 60, weights: Sequence[float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Reciprocal-rank fusion: (ids, fused scores) best first, fused(d) = Σ_r w_r / (k + rank_r(d))
    with ranks from 1 over the rankings that hold d (each ranking's ids distinct).

    Ranks, not scores, so retrievers on unrelated scales need no calibration; ``k`` damps the
    difference between the first places (Cormack et al. 2009 found 60 good across tasks)."""
    given = np.ones(len(rankings)) if weights is None else np.asarray(weights, np.float64)
    lengths = np.array([len(r) for r in rankings], np.int64)
    if not lengths.sum():
        return np.zeros(0, np.int64), np.zeros(0)
    ids = np.concatenate([np.asarray(r, np.int64) for r in rankings])
    ranks = np.concatenate([np.arange(1, n + 1) for n in lengths])  # a few rankings, not chunks
    uniq, inverse = np.unique(ids, return_inverse=True)
    fused = np.bincount(inverse, weights=np.repeat(given, lengths) / (k + ranks), minlength=len(uniq))
    order = np.lexsort((uniq, -fused))
    return uniq[order], fused[order]


TOKENS_PER_BATCH = 4096  # padded positions a forward pass takes: bounds the activations


def query_logprob(
    model,
    contexts: Sequence[np.ndarray],
    query: np.ndarray,
    max_context: int | None = None,
    tokens_per_batch: int = TOKENS_PER_BATCH,
) -> np.ndarray:
    """Mean ln p(query tokens | context) per context (float64, one per context), in batches.

    Each row is the context's last ``max_context`` tokens followed by the query, right-padded
    (a causal model's real positions never see the padding after them, and their position ids
    stay 0..n−1); the logits are taken only at the positions that predict a query token, so the
    vocabulary projection costs |query| rows a candidate instead of the whole row. Rows are
    batched longest first, so a batch pads little.

    The mean, not the sum, so ranks compare across queries of any length; the query's own
    (context-free) likelihood is the same for every candidate, so ranking by this equals ranking
    by the pointwise mutual information of query and context.

    Fed the candidates' stored KV caches instead of their tokens, only the |query| positions
    would be computed per candidate (their attention reading the cached keys and values): the
    context's forward pass, here ~(context / (context + query)) of the work, 90% for a
    200-token chunk and a 20-token query, would be a read instead.
    """
    import torch

    query = np.asarray(query, np.int64)
    q = len(query)
    if not q:
        raise ValueError("an empty query has no likelihood")
    if any(len(c) == 0 for c in contexts):
        raise ValueError("a context must hold at least one token (the one that predicts the query's first)")
    rows = [np.asarray(c, np.int64)[-max_context:] if max_context else np.asarray(c, np.int64) for c in contexts]
    lengths = np.array([len(r) for r in rows], np.int64)
    order = np.argsort(-lengths, kind="stable")
    out = np.zeros(len(rows))
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    query_t = torch.as_tensor(query)
    at = 0
    with torch.inference_mode():
        while at < len(order):
            width = int(lengths[order[at]]) + q
            size = max(1, tokens_per_batch // width)
            batch = order[at : at + size]
            at += size
            ids = np.zeros((len(batch), width), np.int64)
            mask = np.zeros((len(batch), width), np.int64)
            for i, j in enumerate(batch):  # one copy per row, not per token
                n = lengths[j]
                ids[i, :n], ids[i, n : n + q] = rows[j], query
                mask[i, : n + q] = 1
            ids_t, mask_t = torch.as_tensor(ids), torch.as_tensor(mask)
            # position n_i − 1 + j predicts the query's token j
            where = torch.as_tensor(lengths[batch, None] - 1 + np.arange(q)[None, :])
            pick = torch.arange(len(batch))[:, None]
            if softcap:
                logits = model(input_ids=ids_t, attention_mask=mask_t).logits[pick, where].float()
            else:
                hidden = model.base_model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state
                logits = head(hidden[pick, where]).float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, query_t.expand(len(batch), q)[..., None])[..., 0]
            out[batch] = logp.mean(-1).double().numpy()
    return out
