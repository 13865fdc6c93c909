"""Token selection: logits [B, V] + the batch's sequences -> one next token per row.

Order of operations for a row (each step only touches the rows that need it):
  0. logit_bias (token id -> value added to its logit), then the grammar mask of a guided
     row (engine/structured.py: the tokens its xgrammar matcher disallows get -inf; applied
     on the logits' device, after the forward, outside any CUDA graph).
  1. min_tokens: while fewer than `min_tokens` tokens were generated, EOS (unless ignore_eos)
     and `stop_token_ids` get -inf.
  2. repetition penalty (HF semantics, over prompt + output tokens): a seen token's logit is
     divided by the penalty when positive and multiplied by it when negative.
  3. frequency / presence penalties (OpenAI semantics, over output tokens only):
     logit -= frequency_penalty * count + presence_penalty * (count > 0).
  4. greedy rows (temperature ~ 0, or top_k == 1: the same point mass): torch.argmax of the
     processed logits (first index on ties).
  5. sampled rows: logits / temperature; top-k (HF semantics: drop logits below the k-th
     largest, so ties at the k-th value survive); top-p (in probability order, drop a token once
     the mass strictly ahead of it reaches top_p, i.e. keep the smallest nucleus); min-p (drop
     probs < min_p * max prob); then inverse-CDF sampling, in vocabulary order, with one
     uniform number per row. Only rows with top_p < 1 sort (see _top_p_drop).

Randomness: a row whose sequence has `seq.generator` (params.seed set) draws its uniform from
that generator only, so a seeded request gives the same tokens whatever its batch mates or row
position; other rows draw from the sampler's shared generator. Uniforms are drawn on the CPU
(where the generators live) and moved to the logits' device.

Logprobs (params.logprobs = n): log_softmax of the RAW model logits, before min_tokens masking,
penalties and temperature: the model's own distribution, as OpenAI-style APIs report it. The
chosen token's logprob plus the n most likely tokens (best first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from bucketserve.engine.sequence import Sequence, TokenLogprob


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none


def _min_tokens_active(seq: Sequence, pending_offset: int = 0) -> bool:
    # output + pending < min_tokens (tokens still on the device, overlapped scheduling, were
    # generated too); min_tokens_end is prompt + min_tokens, 0 without min_tokens.
    # pending_offset: -1 where the engine counted this step's own token as pending already
    # (LLMEngine.schedule_ahead)
    return len(seq.token_ids) + seq.num_pending + pending_offset < seq.min_tokens_end


PLAIN, MASKED, OTHER = 0, 1, 2  # _row_kind


def _row_kind(s: Sequence, pending_offset: int = 0) -> int:
    """PLAIN: greedy, and nothing but the argmax this step (no logprobs, grammar, bias, penalty
    or active min_tokens); MASKED: the same under a grammar; OTHER: anything else."""
    if not s.argmax_only or _min_tokens_active(s, pending_offset):
        return OTHER
    return PLAIN if s.grammar is None else MASKED


def _counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Token occurrence counts [len(id_lists), vocab] float32, via one scatter_add.

    Lists are right-padded with the id `vocab` (an extra column, dropped afterwards)."""
    width = max((len(ids) for ids in id_lists), default=0)
    padded = torch.full((len(id_lists), width + 1), vocab, dtype=torch.long)
    for r, ids in enumerate(id_lists):
        if ids:
            padded[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(id_lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


# Top-p first looks for the nucleus among this many most likely tokens (a partial top-k is much
# cheaper than sorting the whole vocabulary); rows whose nucleus is wider fall back to a sort.
_NUCLEUS_CANDIDATES = 1024


def _nucleus_keep(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """sorted_probs [P, N] descending -> keep [P, N]: mass strictly ahead < top_p [P, 1]."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return mass_before < top_p  # position 0 always kept (mass_before 0)


def _stable_desc(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids [P, N] (a subset of each row's vocab) ordered by prob descending, ties by lower id."""
    ids = ids.sort(dim=-1).values
    order = torch.sort(probs.gather(1, ids), dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order)


def _top_p_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [P, V], top_p [P, 1] -> drop mask [P, V] in vocab order (smallest nucleus kept).

    Decisions are identical on both paths: the cumsum over the top N equals the first N
    entries of the full cumsum, and when those N already hold top_p of the mass every later
    token is dropped anyway. Which path a row takes depends on that row alone."""
    rows, vocab = probs.shape
    keep = torch.zeros_like(probs, dtype=torch.bool)
    wide = torch.ones(rows, dtype=torch.bool, device=probs.device)
    n = min(vocab, _NUCLEUS_CANDIDATES)
    if n < vocab:
        order = _stable_desc(probs, torch.topk(probs, n, dim=-1).indices)  # [P, n]
        sorted_probs = probs.gather(1, order)
        cum = torch.cumsum(sorted_probs, dim=-1)
        narrow = cum[:, -1] >= top_p[:, 0]  # [P]: the nucleus ends within the top n
        keep.scatter_(1, order, _nucleus_keep(sorted_probs, top_p) & narrow.unsqueeze(1))
        wide = ~narrow
    if bool(wide.any()):
        w = wide.nonzero()[:, 0]
        sorted_probs, order = torch.sort(probs[w], dim=-1, descending=True, stable=True)
        keep[w] = torch.zeros_like(keep[w]).scatter_(1, order, _nucleus_keep(sorted_probs, top_p[w]))
    return ~keep


class Sampler:
    """Callable: Sampler(eos_token_ids)(logits [B, V], seqs) -> SamplerOutput."""

    def __init__(self, eos_token_ids: Iterable[int] = (), seed: int | None = None) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.generator = torch.Generator()  # CPU; shared by rows without their own seed
        self._masks = None  # engine/structured.GrammarMasks, at the first guided row
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        tokens, logprobs = self.sample(logits, seqs)
        return SamplerOutput(tokens.tolist(), logprobs or [None] * len(seqs))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], pending_offset: int = 0,
               inplace: bool = False) -> tuple[torch.Tensor, list[TokenLogprob | None] | None]:
        """-> (token ids [B] long on the logits' device, logprobs per row or None when no row
        asks for them). Plain greedy batches never wait for the device here (the caller
        copies the ids to the host when it needs them); rows with top-p or logprobs do.
        `pending_offset`: added to every row's pending tokens (-1 where the scheduler counted
        this step's token already). `inplace`: the logits are the caller's to lose (a batch
        of greedy rows whose only processing is grammar masks masks them in place)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [len(seqs)={len(seqs)}, vocab], got {tuple(logits.shape)}")
        # Common case: plain greedy everywhere -> one argmax, nothing else. The argmax runs on
        # the logits' own dtype: widening to float32 is exact and keeps the order (and the
        # first of tied maxima), so the result is the same without the [B, V] copy. The check
        # runs for every sequence of every step: one flag (Sequence.sample_plain) for most
        # rows, the whole test (_row_kind) for the others. `masked`: every row is greedy and
        # nothing but a grammar mask changes its logits (g_rows: the rows with a grammar).
        plain = masked = True
        g_rows: list[int] = []
        for i, s in enumerate(seqs):
            if s.sample_plain and s.grammar is None:
                continue
            kind = _row_kind(s, pending_offset)
            if kind == OTHER:
                plain = masked = False
                break
            if kind == MASKED:
                plain = False
                g_rows.append(i)
        if plain:
            return torch.argmax(logits, dim=-1), None
        if masked and inplace:
            # the masks go straight into the logits in their own dtype (no widened copy, no
            # clone), then the argmax
            self._grammar_masks().apply(logits, g_rows, [seqs[i].grammar for i in g_rows])
            return torch.argmax(logits, dim=-1), None
        if logits.dtype != torch.float32:
            logits = logits.float()

        raw = logits
        logits = self.process_logits(logits, seqs, pending_offset)
        tokens = torch.argmax(logits, dim=-1)  # [B]; right for greedy rows, others overwritten
        sampled_rows = [i for i, s in enumerate(seqs) if not s.sample_argmax]
        if sampled_rows:
            tokens[sampled_rows] = self._sample(logits[sampled_rows], [seqs[i] for i in sampled_rows])
        if not any(s.params.logprobs is not None for s in seqs):
            return tokens, None
        return tokens, self._logprobs(raw, seqs, tokens.tolist())

    def start_masks(self, rows: list[int], states: list, b: int, vocab: int,
                    device: torch.device, accepts=None) -> None:
        """Starts the grammar masks of a coming `sample` (engine/structured.GrammarMasks.start):
        rows are the sampled rows with a grammar, `states` their GrammarStates, b the rows
        of its logits and vocab their width; `accepts` (structured.BatchAccepts), the
        previous step's accepts to run first on the fill thread."""
        self._grammar_masks().start(rows, states, b, vocab, torch.device(device), accepts)

    def _grammar_masks(self):
        """The engine/structured.GrammarMasks of this sampler, made at the first guided row."""
        if self._masks is None:
            from bucketserve.engine.structured import GrammarMasks

            self._masks = GrammarMasks()
        return self._masks

    # -- logit processing -------------------------------------------------------------------

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence],
                       pending_offset: int = 0) -> torch.Tensor:
        """Steps 0-3 above (logit bias and grammar masks, min_tokens masking, penalties) -> a
        new [B, V] tensor; input untouched."""
        logits = logits.clone()
        vocab, device = logits.shape[1], logits.device
        # the rows with a bias, min_tokens or a penalty (Sequence.logit_processing): the
        # passes below look at these alone
        special = [i for i, s in enumerate(seqs) if s.logit_processing]

        bias_rows = [i for i in special if seqs[i].params.logit_bias]
        if bias_rows:
            rows: list[int] = []
            cols: list[int] = []
            vals: list[float] = []
            for i in bias_rows:
                for t, v in seqs[i].params.logit_bias.items():
                    rows.append(i)
                    cols.append(t)
                    vals.append(v)
            logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                              torch.tensor(vals, dtype=logits.dtype, device=device), accumulate=True)
        g_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if g_rows:
            self._grammar_masks().apply(logits, g_rows, [seqs[i].grammar for i in g_rows])
        if not special:
            return logits

        # min_tokens: gather (row, token) pairs to ban, one index_put for the batch.
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i in special:
            s = seqs[i]
            if _min_tokens_active(s, pending_offset):
                banned = set(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    banned.update(self.eos_token_ids)
                banned = {t for t in banned if 0 <= t < vocab}
                ban_rows += [i] * len(banned)
                ban_cols += sorted(banned)
        if ban_rows:
            logits[torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device)] = (
                float("-inf"))

        rep_rows = [i for i in special if seqs[i].params.repetition_penalty != 1.0]
        if rep_rows:
            # seen [R, V]: token occurs in prompt or output.
            seen = _counts([seqs[i].token_ids for i in rep_rows], vocab, device) > 0
            pen = torch.tensor([seqs[i].params.repetition_penalty for i in rep_rows],
                               dtype=torch.float32, device=device).unsqueeze(1)  # [R, 1]
            sub = logits[rep_rows]
            penalised = torch.where(sub > 0, sub / pen, sub * pen)
            logits[rep_rows] = torch.where(seen, penalised, sub)

        of_rows = [i for i in special
                   if seqs[i].params.presence_penalty != 0.0 or seqs[i].params.frequency_penalty != 0.0]
        if of_rows:
            counts = _counts([seqs[i].output_token_ids for i in of_rows], vocab, device)  # [R, V]
            freq = torch.tensor([seqs[i].params.frequency_penalty for i in of_rows],
                                dtype=torch.float32, device=device).unsqueeze(1)
            pres = torch.tensor([seqs[i].params.presence_penalty for i in of_rows],
                                dtype=torch.float32, device=device).unsqueeze(1)
            logits[of_rows] -= freq * counts + pres * (counts > 0).float()
        return logits

    # -- sampling -----------------------------------------------------------------------------

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One U[0, 1) per row [R]; seeded rows from their own generator, in row order."""
        u = torch.empty(len(seqs), dtype=torch.float64)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand(1, generator=s.generator, dtype=torch.float64)
        return u

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [R, V] (processed) -> sampled token ids [R] long, same device.

        Every step is row-wise and chosen by the row's own params, so a row's result does not
        depend on its batch mates (needed for per-request seeds)."""
        rows, vocab = logits.shape
        device = logits.device
        params = [s.params for s in seqs]
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        logits = logits / temp.unsqueeze(1)  # [R, V]

        k_rows = [r for r, p in enumerate(params) if 1 < p.top_k < vocab]
        if k_rows:
            ks = [params[r].top_k for r in k_rows]
            top_vals = torch.topk(logits[k_rows], max(ks), dim=-1).values  # [K, k_max], sorted
            kth = top_vals.gather(1, torch.tensor(ks, device=device).unsqueeze(1) - 1)  # [K, 1]
            sub = logits[k_rows]
            logits[k_rows] = sub.masked_fill(sub < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [R, V]

        p_rows = [r for r, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            top_p = torch.tensor([params[r].top_p for r in p_rows], dtype=torch.float32,
                                 device=device).unsqueeze(1)  # [P, 1]
            sub = probs[p_rows]
            probs[p_rows] = sub.masked_fill(_top_p_drop(sub, top_p), 0.0)

        if any(p.min_p > 0 for p in params):  # (decided on the host: no device sync)
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            max_prob = probs.max(dim=-1, keepdim=True).values  # [R, 1]
            probs = probs.masked_fill(probs < min_p.unsqueeze(1) * max_prob, 0.0)

        # Inverse CDF: the first token whose cumulative mass exceeds u * total. Zero-prob tokens
        # never win (their cdf equals their predecessor's); if u * total rounds up to the total,
        # take the last token with mass.
        cdf = torch.cumsum(probs, dim=-1)  # [R, V]
        target = self._uniforms(seqs).to(device=device, dtype=torch.float32) * cdf[:, -1]
        pick = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # [R]
        last_kept = (probs > 0).cumsum(dim=-1).argmax(dim=-1)  # first index of the max count
        return torch.minimum(pick, last_kept)

    # -- logprobs -----------------------------------------------------------------------------

    def _logprobs(self, raw: torch.Tensor, seqs: list[Sequence],
                  token_ids: list[int]) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return out
        lp = torch.log_softmax(raw[rows], dim=-1)  # [R, V]
        chosen = lp.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=lp.device))
        chosen_list = chosen.squeeze(1).tolist()
        n_max = max(seqs[i].params.logprobs for i in rows)
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if n_max > 0:
            vals, ids = torch.topk(lp, n_max, dim=-1)  # sorted, best first
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for r, i in enumerate(rows):
            n = seqs[i].params.logprobs
            top = list(zip(top_ids[r][:n], top_vals[r][:n], strict=True)) if n else []
            out[i] = TokenLogprob(token_ids[i], chosen_list[r], top)
        return out
