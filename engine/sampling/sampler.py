"""Next-token choice for a batch in which every row keeps its own sampling parameters.

The semantics follow TGI's HeterogeneousNextTokenChooser
(server/text_generation_server/utils/tokens.py,
logits_process.py and watermark.py): watermark -> repetition penalty -> frequency penalty ->
(bucketserve's extensions: OpenAI's presence penalty, then logit_bias) -> grammar mask ->
temperature -> top-k -> top-p -> typical-p -> argmax or a random draw, and the reported
log-probabilities are log_softmax of the processed scores. Every processor runs only when some row
of the batch needs it and leaves the other rows' scores bit-for-bit unchanged, so a row gets the
same result alone or in any batch. Where this module departs from TGI on purpose, the comment says
so.
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass

import torch

from engine.batch import NextTokenChooserParameters
from engine.errors import InvalidRequestError
from engine.wire.contract import MAX_LOGIT_BIAS

# Green-list watermarking (Kirchenbauer et al. 2023) with TGI's defaults.
WATERMARK_GAMMA = 0.5  # share of the vocabulary on each green list
WATERMARK_DELTA = 2.0  # logit bonus of a green token
WATERMARK_HASH_KEY = (
    15485863  # a large prime; key * previous token seeds the green-list permutation
)

_MAX_SEED = 2**64 - 1  # torch.Generator takes any unsigned 64-bit seed, as TGI's router draws them


def validate_parameters(request_id: int, params: NextTokenChooserParameters) -> None:
    """Raise InvalidRequestError naming the first parameter the chooser cannot honour.

    Ranges are TGI's router ranges widened to the proto defaults the router sends for "unset" (top_p
    = typical_p = 1, top_k = 0) and to temperature 0, the OpenAI spelling of greedy. NaN fails every
    comparison, so it is rejected too.
    """
    p = params
    rules = (
        (
            "temperature",
            p.temperature,
            math.isfinite(p.temperature) and p.temperature >= 0,
            "a finite number >= 0",
        ),
        ("top_k", p.top_k, p.top_k >= 0, ">= 0"),
        ("top_p", p.top_p, 0 < p.top_p <= 1, "in (0, 1]"),
        ("typical_p", p.typical_p, 0 < p.typical_p <= 1, "in (0, 1]"),
        (
            "repetition_penalty",
            p.repetition_penalty,
            math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0,
            "a finite number > 0",
        ),
        ("frequency_penalty", p.frequency_penalty, math.isfinite(p.frequency_penalty), "finite"),
        ("seed", p.seed, p.seed is None or 0 <= p.seed <= _MAX_SEED, "in [0, 2**64)"),
        ("presence_penalty", p.presence_penalty, math.isfinite(p.presence_penalty), "finite"),
        (
            "logit_bias",
            p.logit_bias,
            all(math.isfinite(v) for v in p.logit_bias.values()),
            "finite",
        ),
        (
            "logit_bias",
            f"{len(p.logit_bias)} entries",
            len(p.logit_bias) <= MAX_LOGIT_BIAS,
            f"at most {MAX_LOGIT_BIAS} entries",
        ),
    )
    for name, value, ok, rule in rules:
        if not ok:
            raise InvalidRequestError(
                f"request {request_id}: parameters.{name} must be {rule}, got {value}"
            )


def is_sampling(params: NextTokenChooserParameters) -> bool:
    """Whether the row draws at random rather than taking the argmax.

    Like TGI, any non-default warper turns sampling on even without do_sample; temperature 0 turns
    it off.
    """
    if params.temperature == 0:
        return False
    return (
        params.do_sample
        or params.temperature != 1.0
        or params.top_k != 0
        or params.top_p < 1.0
        or params.typical_p < 1.0
    )


@dataclass
class SamplingState:
    """A request's chooser state. It lives on the request's Sequence, so it survives batch filtering
    and concatenation; penalties need nothing more because they are recomputed from the token
    history at every step."""

    params: NextTokenChooserParameters
    seed: int  # the seed in use, reported back in GeneratedText.seed
    generator: (
        torch.Generator
    )  # CPU, so one seed gives the same draws whatever device the logits are on


def new_sampling_state(
    params: NextTokenChooserParameters, request_id: int, unset_seed: int | None = None
) -> SamplingState:
    """Validate `params` and seed the request's generator.

    seed None means "unset" (the dataclass default), so it is replaced by `unset_seed`, else by a
    fresh random 64-bit seed; 0 is a seed like any other, as on the wire. TGI's router always sends
    a seed, so None only comes from direct callers. Shards of one model must draw the
    same token, so a sharded engine passes an `unset_seed` that every rank agrees on.
    """
    validate_parameters(request_id, params)
    fallback = unset_seed if unset_seed is not None else secrets.randbits(64)
    seed = params.seed if params.seed is not None else fallback
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return SamplingState(params, seed, generator)


@dataclass
class Choice:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token under the processed scores
    top_tokens: list[
        list[tuple[int, float]]
    ]  # per row, its top_n (id, logprob) pairs; [] when top_n == 0


@dataclass(frozen=True)
class _Rows:
    """One batch's parameters as columns. Warper columns hold neutral values on rows that do not
    sample, so a warper leaves those rows untouched."""

    sampling: list[bool]
    watermark: list[bool]
    repetition_penalty: list[float]
    frequency_penalty: list[float]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    typical_p: list[float]
    presence_penalty: list[float]
    logit_bias: list[dict[int, float]]

    @classmethod
    def of(cls, states: list[SamplingState]) -> _Rows:
        params = [s.params for s in states]
        sampling = [is_sampling(p) for p in params]

        def warper(name: str, neutral: float) -> list:
            return [getattr(p, name) if draws else neutral for p, draws in zip(params, sampling)]

        return cls(
            sampling,
            [p.watermark for p in params],
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            warper("temperature", 1.0),
            warper("top_k", 0),
            warper("top_p", 1.0),
            warper("typical_p", 1.0),
            [p.presence_penalty for p in params],
            [p.logit_bias for p in params],
        )

    def needs_penalty(self) -> list[bool]:
        return [
            r != 1.0 or f != 0.0 for r, f in zip(self.repetition_penalty, self.frequency_penalty)
        ]

    def needs_warper(self) -> bool:
        return (
            any(t != 1.0 for t in self.temperature)
            or any(self.top_k)
            or any(p < 1.0 for p in self.top_p)
            or any(p < 1.0 for p in self.typical_p)
        )

    def plain(self) -> bool:
        """No row needs a processor: the scores are the logits themselves."""
        return not (
            any(self.watermark)
            or any(self.needs_penalty())
            or self.needs_warper()
            or any(self.presence_penalty)
            or any(self.logit_bias)
        )


def choose(
    logits: torch.Tensor,
    states: list[SamplingState],
    histories: list[list[int]],
    prompt_lens: list[int],
    top_n: list[int],
    allowed: torch.Tensor | None = None,
) -> Choice:
    """One next token per row of `logits` [n, vocab], each row with its own parameters and
    generator.

    histories[i] is row i's prompt followed by its generated tokens; prompt_lens only checks that
    the prompt is there, since TGI's penalties count prompt and generated tokens alike. allowed
    (bool [n, vocab], True = allowed) masks tokens a grammar forbids. Work stays on logits.device;
    only one uniform per sampling row comes from the CPU.
    """
    _check_batch(logits, states, histories, prompt_lens, top_n, allowed)
    if logits.shape[0] == 0:
        return Choice([], [], [])
    rows = _Rows.of(states)
    scores = _process(logits, rows, histories, allowed, prompt_lens)
    chosen = scores.argmax(dim=1)
    drawing = [i for i, draws in enumerate(rows.sampling) if draws]
    if drawing:
        chosen[drawing] = _draw(scores[drawing], [states[i].generator for i in drawing])
    logprobs = torch.log_softmax(scores, dim=1)
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return Choice(chosen.tolist(), chosen_logprobs.tolist(), _top_tokens(logprobs, top_n))


def plain_greedy(state: SamplingState) -> bool:
    """Whether the row's next token is the argmax of its logits as they are: it does not sample,
    and no processor (penalty, bias, watermark) changes its scores."""
    return not is_sampling(state.params) and _Rows.of([state]).plain()


def process_scores(
    logits: torch.Tensor,
    states: list[SamplingState],
    histories: list[list[int]],
    allowed: torch.Tensor | None = None,
    prompt_lens: list[int] | None = None,
) -> torch.Tensor:
    """The scores choose() picks from: `logits` after every row's processors and warpers. `logits`
    is not modified; when no row needs a processor the result is `logits` itself (as float32), so
    treat it as read-only."""
    return _process(logits, _Rows.of(states), histories, allowed, prompt_lens)


def _process(
    logits: torch.Tensor,
    rows: _Rows,
    histories: list[list[int]],
    allowed: torch.Tensor | None,
    prompt_lens: list[int] | None = None,
) -> torch.Tensor:
    if rows.plain() and allowed is None:
        return logits.float()  # the greedy fast path: no copy when the logits already are float32
    scores = logits.to(torch.float32, copy=True)  # the processors below work in place
    if any(rows.watermark):
        _watermark_(scores, rows.watermark, histories)
    if any(rows.needs_penalty()):
        _penalties_(scores, rows, histories)
    if any(rows.presence_penalty):
        _presence_(
            scores, rows.presence_penalty, histories, prompt_lens or [len(h) for h in histories]
        )
    if any(rows.logit_bias):
        _logit_bias_(scores, rows.logit_bias)
    if allowed is not None:
        scores.masked_fill_(~allowed, -math.inf)
    if rows.needs_warper():
        _warpers_(scores, rows)
    return scores


def _check_batch(logits, states, histories, prompt_lens, top_n, allowed) -> None:
    """Caller mistakes, reported as such rather than as a shape error deep inside torch."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    if any(len(column) != n for column in (states, histories, prompt_lens, top_n)):
        raise ValueError(
            f"{n} rows of logits, but {len(states)} states, {len(histories)} histories, "
            f"{len(prompt_lens)} prompt lengths and {len(top_n)} top_n values"
        )
    for i, (history, prompt_len) in enumerate(zip(histories, prompt_lens)):
        if not 0 < prompt_len <= len(history):
            raise ValueError(
                f"row {i}: the history ({len(history)} tokens) must start with the prompt "
                f"({prompt_len})"
            )
    if allowed is not None:
        if allowed.shape != logits.shape or allowed.dtype != torch.bool:
            raise ValueError(f"allowed must be a bool tensor of shape {tuple(logits.shape)}")
        if not bool(allowed.any(dim=1).all()):
            raise ValueError("a row's grammar allows no token at all")


@functools.lru_cache(maxsize=64)
def _green_list(previous_token: int, vocab_size: int) -> torch.Tensor:
    """The watermark's green token ids after `previous_token`: the head of a permutation seeded by
    it. Read-only.

    TGI draws the permutation with a generator on the model's device, so its GPU green lists differ
    from its CPU ones; this one always uses the CPU so that a detector gets the same list wherever
    the text was generated. A CPU randperm of a 150k vocabulary takes milliseconds, and frequent
    tokens come back often: hence the cache (64 lists of int32, about 20 MB at that vocabulary).
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(WATERMARK_HASH_KEY * previous_token)
    permutation = torch.randperm(vocab_size, generator=generator)
    return permutation[: int(vocab_size * WATERMARK_GAMMA)].to(torch.int32)


def _watermark_(scores: torch.Tensor, watermark: list[bool], histories: list[list[int]]) -> None:
    # One green list per row and step, as in TGI; watermarking is rare enough that a loop over its
    # rows is fine.
    for i in (i for i, on in enumerate(watermark) if on):
        green = _green_list(histories[i][-1], scores.shape[1]).to(scores.device)
        bonus = torch.full(
            (green.numel(),), WATERMARK_DELTA, dtype=scores.dtype, device=scores.device
        )
        scores[i].index_add_(
            0, green, bonus
        )  # ids are distinct, so each green score gets exactly + delta


def _penalties_(scores: torch.Tensor, rows: _Rows, histories: list[list[int]]) -> None:
    """TGI's repetition then frequency penalty, both over prompt and generated tokens."""
    counts, lengths = _token_counts(histories, rows.needs_penalty(), scores)
    if any(r != 1.0 for r in rows.repetition_penalty):
        # CTRL (Keskar et al. 2019): every token already seen moves towards "less likely" by the
        # factor penalty.
        penalty = _column(rows.repetition_penalty, scores)
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores.copy_(torch.where(counts > 0, penalized, scores))
    if any(f != 0.0 for f in rows.frequency_penalty):
        # TGI subtracts penalty * (occurrences / history length), not OpenAI's penalty *
        # occurrences.
        scores.sub_(counts / lengths * _column(rows.frequency_penalty, scores))


def _token_counts(
    histories: list[list[int]], needed: list[bool], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token occurs in each needed row's history ([n, vocab], zero on other rows),
    and every row's history length ([n, 1]). TGI divides by the batch's padded width and counts the
    padding as token 0; the row's own length keeps a row's penalty independent of its batch."""
    row_index = [i for i, history in enumerate(histories) if needed[i] for _ in history]
    token_index = [t for i, history in enumerate(histories) if needed[i] for t in history]
    counts = torch.zeros_like(like)
    ones = torch.ones(len(token_index), dtype=like.dtype, device=like.device)
    index = (
        torch.tensor(row_index, dtype=torch.long, device=like.device),
        torch.tensor(token_index, dtype=torch.long, device=like.device),
    )
    counts.index_put_(index, ones, accumulate=True)  # exact: small integers in float32
    lengths = _column([max(len(h), 1) for h in histories], like)
    return counts, lengths


def _presence_(
    scores: torch.Tensor, penalty: list[float], histories: list[list[int]], prompt_lens: list[int]
) -> None:
    """OpenAI's presence penalty: every token generated so far (not the prompt's, as OpenAI and vLLM
    define it) loses `penalty` once, however often it occurs."""
    rows = [i for i, p in enumerate(penalty) if p for _ in histories[i][prompt_lens[i] :]]
    tokens = [t for i, p in enumerate(penalty) if p for t in histories[i][prompt_lens[i] :]]
    if not tokens:
        return
    seen = torch.zeros_like(scores)
    seen[torch.tensor(rows, device=scores.device), torch.tensor(tokens, device=scores.device)] = 1.0
    scores.sub_(seen * _column(penalty, scores))


def _logit_bias_(scores: torch.Tensor, biases: list[dict[int, float]]) -> None:
    """OpenAI's logit_bias, a sparse [rows, vocab] addition; ids past the logits' vocabulary are
    ignored."""
    vocab = scores.shape[1]
    entries = [
        (i, token, bias)
        for i, row in enumerate(biases)
        for token, bias in row.items()
        if 0 <= token < vocab
    ]
    if entries:
        rows, tokens, values = zip(*entries)
        index = (
            torch.tensor(rows, device=scores.device),
            torch.tensor(tokens, device=scores.device),
        )
        scores.index_put_(
            index, torch.tensor(values, dtype=scores.dtype, device=scores.device), accumulate=True
        )


def _warpers_(scores: torch.Tensor, rows: _Rows) -> None:
    if any(t != 1.0 for t in rows.temperature):
        scores.div_(_column(rows.temperature, scores))
    if any(rows.top_k):
        _top_k_(scores, rows.top_k)
    if any(p < 1.0 for p in rows.top_p):
        _top_p_(scores, rows.top_p)
    if any(p < 1.0 for p in rows.typical_p):
        _typical_p_(scores, rows.typical_p)


def _top_k_(scores: torch.Tensor, top_k: list[int]) -> None:
    """Keep each row's k best scores, with every score tied with the k-th (as TGI); k = 0 keeps
    all."""
    vocab = scores.shape[1]
    k = [min(k, vocab) for k in top_k]
    best = scores.topk(max(k), dim=1).values
    k_column = torch.tensor(k, device=scores.device).unsqueeze(1)
    kth = best.gather(1, (k_column - 1).clamp(min=0))
    kth.masked_fill_(k_column == 0, -math.inf)
    scores.masked_fill_(scores < kth, -math.inf)


def _top_p_(scores: torch.Tensor, top_p: list[float]) -> None:
    """Nucleus: keep the most likely tokens until their mass reaches p; the best token always
    stays."""
    ascending, order = scores.sort(dim=1)
    tail_mass = ascending.softmax(dim=1).cumsum(dim=1)
    # A token goes when it and every less likely token together weigh at most 1 - p (TGI's form of
    # the rule).
    drop = tail_mass <= 1 - _column(top_p, scores)
    drop[:, -1] = False
    drop &= _active(top_p, scores)  # p = 1 rows: leave even underflowed tokens alone
    scores.masked_fill_(_unsort(drop, order), -math.inf)


def _typical_p_(scores: torch.Tensor, typical_p: list[float]) -> None:
    """Locally typical sampling (Meister et al. 2022): keep the tokens whose surprise is nearest the
    entropy, in that order, until their mass reaches p."""
    log_probs = scores.log_softmax(dim=1)
    entropy = -(log_probs * log_probs.exp()).nansum(
        dim=1, keepdim=True
    )  # masked tokens give -inf * 0 = nan
    distance = (-log_probs - entropy).abs()
    nearest, order = distance.sort(dim=1)
    mass = scores.gather(1, order).softmax(dim=1).cumsum(dim=1)
    last_kept = (
        (mass < _column(typical_p, scores)).sum(dim=1, keepdim=True).clamp(max=scores.shape[1] - 1)
    )
    drop = nearest > nearest.gather(1, last_kept)  # ties with the last kept token stay, as in TGI
    drop &= _active(typical_p, scores)
    scores.masked_fill_(_unsort(drop, order), -math.inf)


def skip_draws(state: SamplingState, steps: int) -> None:
    """Advance a request's generator past `steps` steps it already took (each draws one uniform in
    `_draw` when the request samples): a request resumed after a shard restart then draws what it
    would have drawn without the restart."""
    if is_sampling(state.params):
        for _ in range(steps):
            torch.rand(1, generator=state.generator, dtype=torch.float64)


def _draw(scores: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row from softmax(scores), by inverting the row's CDF at a uniform from the
    row's own generator.

    torch.multinomial (and TGI's exponential race) need random numbers made on the logits' device;
    this needs one uniform per row, drawn on the CPU, so a seed means the same tokens on every
    device and the vocabulary-sized work stays on the device.
    """
    uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    probs = scores.softmax(dim=1)
    cdf = probs.double().cumsum(dim=1)
    total = cdf[:, -1:]
    target = uniforms.to(scores.device).unsqueeze(1) * total
    # u * total may round up to total; staying below it lands on the last token with mass at the
    # farthest.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # A parallel cumsum can give a masked (zero-mass) token a sliver of the CDF; never return one.
    has_mass = probs.gather(1, drawn.unsqueeze(1)).squeeze(1) > 0
    return torch.where(has_mass, drawn, probs.argmax(dim=1))


def _top_tokens(logprobs: torch.Tensor, top_n: list[int]) -> list[list[tuple[int, float]]]:
    """Each row's top_n most likely tokens, best first. As TGI: tokens tied with the n-th come too,
    and tokens with log-probability -inf never do (they are not candidates, and JSON cannot carry
    -inf)."""
    vocab = logprobs.shape[1]
    n = [min(max(k, 0), vocab) for k in top_n]
    if max(n, default=0) == 0:
        return [[] for _ in top_n]
    n_column = torch.tensor(n, device=logprobs.device).unsqueeze(1)
    nth = logprobs.topk(max(n), dim=1).values.gather(1, (n_column - 1).clamp(min=0))
    candidates = (logprobs >= nth) & (logprobs > -math.inf)
    counts = torch.where(n_column.squeeze(1) > 0, candidates.sum(dim=1), 0).tolist()
    values, ids = logprobs.topk(max(max(counts), 1), dim=1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[i][:c], values[i][:c])) for i, c in enumerate(counts)]


def _column(values: list, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _active(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """[n, 1] True on rows whose probability-mass warper is on (value < 1)."""
    return torch.tensor([v < 1.0 for v in values], device=like.device).unsqueeze(1)


def _unsort(sorted_mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """A mask over sorted positions, moved back to vocabulary positions."""
    return torch.zeros_like(sorted_mask).scatter_(1, order, sorted_mask)


def allowed_tokens(ctx, sequences, logits):
    """[rows, vocab] mask of allowed tokens (a grammar's, and no EOS before min_new_tokens), or None
    when no row restricts its tokens. `ctx` is the step's StepContext (its eos_token_ids),
    `sequences` its rows."""
    early = [
        i
        for i, s in enumerate(sequences)
        if s.generated < s.request.stopping_parameters.min_new_tokens
        and not (s.grammar is not None and s.grammar.is_complete)
    ]  # a complete grammar may need its EOS
    if all(s.grammar is None for s in sequences) and not early:
        return None
    if all(s.grammar is None for s in sequences):
        allowed = torch.ones(len(sequences), logits.shape[1], dtype=torch.bool)
    else:
        from engine.grammar import allowed_masks  # xgrammar is imported only when a grammar is used

        allowed = allowed_masks([s.grammar for s in sequences], logits.shape[1])
    eos = [t for t in ctx.eos_token_ids if t < logits.shape[1]]
    if early and eos:
        allowed[torch.tensor(early).unsqueeze(1), torch.tensor(eos).unsqueeze(0)] = False
    return allowed.to(logits.device)
