"""The one cost model: which draft tokens a verify forward is worth, from measured costs.

Every draft source is judged on its own record, so a weak source can neither drag a strong one's
budget down nor crowd its tree (ngram + int8 must never lose to the better of the two alone).

Per source, per generation: a decayed estimate of the per-token acceptance a_s (probability that
the next draft token is right, given the ones before it were). Expected tokens committed by a
chain of k drafts is E(k) = (1 - a^(k+1)) / (1 - a); a source is asked for the k maximising
E(k) / (verify(k+1) + draft_s(k)) (`choose_k`), or not at all (k = 0) when no k beats a plain
step; such a source is re-probed now and then, backing off while probes keep failing, so a
drafter that starts agreeing (the output begins to quote the input) is picked up again.

Once the sources have answered, `select` prunes the merged tree: each node's chance of ending on
the accepted path comes from its owners' acceptance (`TokenTree.node_values`), nodes are taken
best first (always prefix-closed) and the tree is cut where expected tokens per second of verify
is highest. Drafting already spent is sunk and does not count there.

A source with nothing to offer yet may say its drafts are due in w seconds (a remote proposer
answering the commit just pushed); `wait_pays` waits for them only when E(k) / (w + verify(k+1))
beats a plain step, so a fast proposer is waited for a millisecond and a slow or unhelpful one
never. k there is what the source has actually brought after such waits (`record_delivered`),
not the budget: a model proposer no faster than the verifier brings one token per wait however
many it is asked for (seen on an H100 verifier with a CPU int8 proposer: 30 ms waits for one
token each, against a 28 ms plain step).

Verify cost is learnt per fed-token count (it is strongly sublinear on CPU), draft cost per
drafted token and per source; both belong to the backend, device and drafter and are kept
across generations. So is a batched forward's cost as a function of the total rows it feeds
(`batch_cost`, learnt from batched forwards only): each sequence plans its tree as alone, then
`fit_batch` trims the batch's least valuable draft nodes while the rows they add cost the batch
more than the tokens they are expected to buy, so under load speculation narrows toward plain
batched decoding and at low load (rows nearly free) every sequence keeps its own plan. Prompt
rows riding along are the prompts' cost, not a reason to draft: drafts are judged against the
decode step, and the prompts they would delay count like running sequences.

A source may name the class of its next draft (`DraftSource.draft_class`: how long a context
match it continues); each class has its own estimate and record. A chain continuing a match of
L tokens continues one of L + j tokens with its (j+1)-th token, so each chain token is judged
by its own class along that ladder (`class_at`, `chain_acceptance`): in `choose_k`, in the
tree's node values and in what a verified block records. A class the chain climbs to but this
generation has not drafted from yet follows the source's phase in this generation (its seed).

A source's acceptance starts each generation from its record, never below the prior: a
long-run estimate per source (counts decayed by `_LONG_DECAY` per block, kept across
generations and shared by forks like the costs) seeds the new generation's estimate with the
prior's weight, so a source that has been right (a suffix drafter serving exact repeats, a
drafter that is the model's own copy) is asked for its large budget from the first step,
while the new prompt's first blocks soon outweigh the seed (one wrong long draft halves it).
A source with a poor record starts at the prior, as every source did before: a prompt it
helps with (one that copies its input) is not held back by the ones before, and one it does
not help with turns it down within a few steps, as before. A match-length class starts at its
own record, however poor (`start_acceptance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from nodes.engine.sources import class_at, names_match

_DECAY = 0.7  # weight of history per block: acceptance comes in phases (copying or not)
#: the same for a source's long-run estimate, kept across generations (~10 blocks of memory)
_LONG_DECAY = 0.9
_EMA = 0.3
#: the source key of callers that do not name one (a single drafter)
POOLED = ""
#: sources (and their draft classes) a verifier's records keep (`keep_newest`): it meets proposers
#: for as long as it runs, each restart under a new name; the least recently updated go first
MAX_RECORDS = 4096
#: joins a source's name and a draft class (`class_key`)
_CLASS_SEP = "#"


def class_key(name: str, label: str | None) -> str:
    """The estimate key of `name`'s drafts of class `label` (`DraftSource.draft_class`);
    `name` itself when the source names no class."""
    return name if label is None else f"{name}{_CLASS_SEP}{label}"


@lru_cache(maxsize=4096)
def _ladder(key: str, n: int) -> tuple[str, ...]:
    """The estimate keys of the first n tokens of a chain whose first token is judged by
    `key`: a class key climbs its class's ladder (`class_at`), any other key is its own at
    every depth. Cached: asked for every source every step, from a bounded set of keys."""
    source, sep, label = key.partition(_CLASS_SEP)
    if not sep:
        return (key,) * n
    return tuple(class_key(source, class_at(label, j)) for j in range(n))


def _names_match(key: str) -> bool:
    """Whether `key` is a source's match-length class (`names_match`)."""
    _, sep, label = key.partition(_CLASS_SEP)
    return bool(sep) and names_match(label)


def _source_of(key: str) -> str | None:
    """The source name of a class key (`class_key`); None for a plain source name."""
    name, sep, _ = key.partition(_CLASS_SEP)
    return name if sep else None


def ema(old: float | None, new: float) -> float:
    """The running estimates' update: the first observation as is, then an EMA."""
    return new if old is None else (1 - _EMA) * old + _EMA * new


@dataclass
class _SourceEstimate:
    """One source's acceptance and probing state for the current generation."""

    acc: float
    trials: float
    probe_interval: int
    #: the acceptance it was seeded with, and that seed's weight left in acc/trials (decayed
    #: with every observation): `batch_acceptance` swaps the seed for the source's record
    seed: float = 0.0
    seed_weight: float = 0.0
    #: observations recorded this generation
    observed: int = 0
    plain_streak: int = 0
    #: steps in a row it was asked for drafts and had none in the verified tree
    unheard: int = 0
    #: it streams its drafts (`DraftSource.streams`: a remote proposer), so unheard may mean late
    streams: bool = False
    #: it streams, and its drafts came too late to be verified `probe_interval` asks in a row:
    #: asked only in probes (like a source not worth asking) until one of its drafts is verified
    late: bool = False
    probing: bool = False

    @property
    def acceptance(self) -> float:
        return self.acc / self.trials


@dataclass
class CostModel:
    max_k: int = 16
    min_k: int = 1
    probe_every: int = 8
    max_probe_every: int = 32
    prior_acceptance: float = 0.5
    prior_weight: float = 2.0
    #: verify cost before measurements, relative to one token: 2 tokens cost prior_jump, each
    #: further token prior_slope more (SmolLM2-135M on 2 CPU cores: 56 ms, 93 ms, ... 133 ms at 17)
    prior_jump: float = 1.5
    prior_slope: float = 0.03
    margin: float = 1.0
    #: the longest probe: a probe's draft length is the k that would pay best if the source
    #: were as good as the prior (`probe_length`), at most this
    probe_k: int = 6
    #: the most of the verifier's time probing one source may take: a probe waits at most
    #: this share of the plain steps between two probes (`probe_wait`)
    probe_share: float = 0.03
    #: fed tokens -> EMA seconds, with its fitted line kept (`_VerifyPoints`); shared by forks
    _verify: _VerifyPoints = field(default_factory=lambda: _VerifyPoints())
    #: rows fed by a batched forward (several sequences) -> EMA seconds; shared by forks
    _batch: dict[int, float] = field(default_factory=dict)
    #: source -> seconds per drafted token (EMA); a dict so forks share it
    _draft: dict[str, float] = field(default_factory=dict)
    #: source -> draft tokens it brought after a wait for it (EMA); shared by forks like _draft
    _delivered: dict[str, float] = field(default_factory=dict)
    #: sources late when last judged (`_SourceEstimate.late`), shared by forks: what the
    #: verifier reads to let a late proposer reading hidden states sit out whole generations
    #: (`ProposerLink.sits_out`). A new generation does not start them late: whether drafts
    #: are in time depends on the text (a far ngram proposer is late on open-ended answers and
    #: in time on ones that copy their prompt: started late, it lost 1.3-1.8x -> ~1.0x there)
    _late: dict[str, bool] = field(default_factory=dict)
    #: source -> this generation's acceptance and probing state
    _sources: dict[str, _SourceEstimate] = field(default_factory=dict)
    #: source -> [accepted, trials] over every generation (decayed): a new generation's
    #: starting point; a dict so forks share it
    _longrun: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.start_generation()

    def start_generation(self) -> None:
        """Restart acceptance (it belongs to the previous prompt) from each source's record
        (`_source`); keep the learnt costs."""
        self._sources = {}

    def fork(self) -> CostModel:
        """A per-sequence model: fresh acceptance (seeded from each source's record); verify
        and draft costs and the records shared with this one (they belong to the backend,
        device and drafter, not to a prompt)."""
        other = type(self)(
            max_k=self.max_k, min_k=self.min_k, probe_every=self.probe_every,
            max_probe_every=self.max_probe_every, prior_acceptance=self.prior_acceptance,
            prior_weight=self.prior_weight, prior_jump=self.prior_jump,
            prior_slope=self.prior_slope, margin=self.margin, probe_k=self.probe_k,
        )
        other._verify = self._verify
        other._batch = self._batch
        other._draft = self._draft
        other._delivered = self._delivered
        other._late = self._late
        other._longrun = self._longrun
        return other

    # ---- estimates --------------------------------------------------------------------------
    def _source(self, name: str) -> _SourceEstimate:
        est = self._sources.get(name)
        if est is None:
            # the seed is decayed like any observation, so evidence soon outweighs it
            start = self._seed(name)
            est = _SourceEstimate(start * self.prior_weight, self.prior_weight,
                                  self.probe_every, seed=start, seed_weight=self.prior_weight)
            self._sources[name] = est
        return est

    def _seed(self, name: str) -> float:
        """Where `name`'s estimate starts in this generation. A draft class first met in this
        generation starts from what its source has been worth in this generation so far,
        where it has been observed: the phase (an answer copying its prompt, or not) is the
        generation's, the class's record is an average over both."""
        source = _source_of(name)
        base = None if source is None else self._sources.get(source)
        if base is not None and base.observed:
            return base.acceptance
        return self.start_acceptance(name)

    def start_acceptance(self, name: str = POOLED) -> float:
        """Where `name`'s acceptance starts a generation: its long-run estimate over earlier
        generations, never below the prior (a poor record must not hold back a prompt the
        source helps with: it is turned down within a few steps where it does not) except
        for a match-length class with a record of at least the prior's weight. Such a record
        is the rate of one kind of draft token, the one continuing a match of that length,
        on every prompt: a prompt that copies its input climbs to the long-match classes,
        whose records carry it, and a floor under the short ones only bought a wrong 7-12
        token draft at the start of every open-ended answer (docs/engine.md, "Acceptance
        along the chain")."""
        rec = self._longrun.get(name)
        if rec is None or rec[1] <= 0:
            return self.prior_acceptance
        if rec[1] >= self.prior_weight and _names_match(name):
            return rec[0] / rec[1]
        return max(self.prior_acceptance, rec[0] / rec[1])

    def acceptance_of(self, name: str = POOLED) -> float:
        """Estimated probability that `name`'s next draft token is accepted. Reading does not
        start an estimate: a class not yet drafted in this generation (one a chain would
        climb to: `chain_acceptance`) follows its seed, and so the generation's phase, until
        it is observed."""
        est = self._sources.get(name)
        return self._seed(name) if est is None else est.acceptance

    def batch_acceptance(self, name: str = POOLED) -> float:
        """`acceptance_of(name)` with what is left of its seed taken from the source's long-run
        record where that is lower than the seed (the prior): the estimate a draft on the
        whole batch's time is judged by. Why: alone, a source starts each generation at
        least at the prior so a prompt it helps with is not held back (a wrong "yes" costs
        one sequence a few rows); in a batch every sequence waits while one drafts, so
        before this generation's own evidence outweighs the seed the source's record over
        earlier generations stands (measured: the EAGLE head, right ~0.2-0.35 of the time,
        drafted each new sequence's first blocks at the prior's 0.5 and lost 9-12 % of a
        batch of 8)."""
        est = self._source(name)
        rec = self._longrun.get(name)
        if rec is None or rec[1] <= 0 or rec[0] / rec[1] >= est.seed:
            return est.acceptance
        acc = est.acc - est.seed_weight * (est.seed - rec[0] / rec[1])
        return max(0.0, acc) / est.trials

    @property
    def acceptance(self) -> float:
        """The single (unnamed) source's estimate."""
        return self.acceptance_of(POOLED)

    def is_late(self, name: str) -> bool:
        """Whether `name`'s drafts came too late to be verified when it was last judged
        (`_SourceEstimate.late`; a record only: a new generation asks it again)."""
        return name in self._late

    def probing(self, name: str = POOLED) -> bool:
        """Whether `name`'s current proposal is a probe (kept in the tree whatever it is worth)."""
        est = self._sources.get(name)
        return est is not None and est.probing

    def verify_cost(self, n: int) -> float:
        """Seconds for a verifier forward over n tokens, learnt: a measured count's cost (the
        multi-token ones read non-decreasing: `_VerifyPoints.ordered`), else the curve
        through the measured ones (`_VerifyPoints.line`)."""
        points = self._verify
        if n in points:
            return points[n] if n == 1 else points.ordered()[n]
        c1, x0, y0, slope, floor = points.line(self.prior_jump, self.prior_slope)
        return c1 if n == 1 else max(y0 + slope * (n - x0), floor)

    def batch_cost(self, rows: int) -> float:
        """Seconds for a batched forward feeding `rows` rows in all, learnt from batched
        forwards: the measured row counts' costs, made non-decreasing (a row never saves
        time; neighbours out of order are pooled to their mean, so one slow sample does not
        raise every larger count), joined by straight lines and continued past the ends with
        the nearest segment's slope above the largest count; below the smallest (and with one
        point) the solo curve scaled through it, never the segment's line, which a steep
        first segment (prompt rows) would carry to zero or below. Before any batched forward,
        the solo curve `verify_cost(rows)` (a batch judged as one long sequence)."""
        if not self._batch:
            return self.verify_cost(rows)
        xs = sorted(self._batch)
        ys = _non_decreasing([self._batch[x] for x in xs])
        if len(xs) == 1 or rows < xs[0]:  # the solo curve's shape, scaled through a point
            return ys[0] * self.verify_cost(rows) / self.verify_cost(xs[0])
        for j in range(1, len(xs)):
            if rows <= xs[j] or j == len(xs) - 1:
                x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
                return max(0.0, y0 + (y1 - y0) * (rows - x0) / (x1 - x0))
        raise AssertionError("unreachable")

    def draft_cost(self, name: str = POOLED) -> float:
        """Seconds per token `name` drafts on the verifier's time (0 for remote drafts)."""
        return self._draft.get(name, 0.0)

    def chain_acceptance(self, name: str, n: int) -> list[float]:
        """The acceptance of each of the first n tokens of a chain whose first token is of
        `name` (a class key climbs its ladder along the chain: `class_at`)."""
        return [self.acceptance_of(key) for key in _ladder(name, n)]

    def _gains(self, name: str, k: int) -> list[float]:
        """`expected_tokens(j, name)` for j = 0 .. k, computed once."""
        gains, p = [1.0], 1.0
        for a in self.chain_acceptance(name, k):
            p *= min(max(a, 0.0), 0.999)
            gains.append(gains[-1] + p)
        return gains

    def expected_tokens(self, k: int, name: str = POOLED, a: float | None = None) -> float:
        """Tokens a block of k of `name`'s drafts is expected to commit (bonus included): each
        chain token by its own class's estimate (`chain_acceptance`), or every one at `a`."""
        if a is None:
            return self._gains(name, k)[k]
        a = min(a, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    # ---- decisions --------------------------------------------------------------------------
    def choose_k(self, name: str = POOLED) -> int:
        """How many tokens to ask `name` for in the next step; 0 means do not ask."""
        est = self._source(name)
        if est.probing:  # the last probe brought nothing to judge: as good as a failed one
            est.probing = False
            est.probe_interval = min(2 * est.probe_interval, self.max_probe_every)
        if est.late:  # nothing to weigh until a probe is heard
            return self._not_asked(est)
        gains, draft = self._gains(name, self.max_k), self.draft_cost(name)

        def rate(k: int) -> float:  # committed tokens per second of a block of k drafts
            return gains[k] / (self.verify_cost(k + 1) + draft * k)

        best_k = max(range(self.min_k, self.max_k + 1), key=rate)
        # demand a margin: costs are noisy, and a wrong "yes" costs more than a wrong "no"
        if rate(best_k) > self.margin * rate(0):
            est.plain_streak = 0
            if est.unheard < est.probe_interval:
                return best_k
            est.unheard = 0
            if not est.streams:
                # asked, never in a verified tree (a grammar with nothing forced, a lookup
                # with no match): its estimate cannot move unless this one is a probe
                est.probing = True
                return best_k
            # asked, but never in a verified tree: its drafts come too late (a remote
            # proposer no faster than this verifier, or far away, on text it cannot guess
            # far ahead). Asking is not free: every commit is pushed to it and its answers
            # read on this core, 7-9 % of a quantized step for nothing (open-ended text, an
            # int8 or ngram proposer 50 ms away). So it is asked no more but in probes, like
            # a source not worth asking, until one of its drafts is verified
            est.late = True
            keep_newest(self._late, name, True, MAX_RECORDS)
        return self._not_asked(est)

    def _not_asked(self, est: _SourceEstimate) -> int:
        """choose_k for a source not worth asking (or late): 0, or a probe every
        `probe_interval` such steps."""
        est.plain_streak += 1
        if est.plain_streak >= est.probe_interval:
            est.plain_streak = 0
            est.probing = True
            return self.probe_length()
        return 0

    def fit_draft_to_batch(self, k: int, name: str, sequences: int,
                           key: str | None = None) -> int:
        """At most k tokens of `name`'s drafts, cut to what pays when `sequences` share the
        step, for a source that drafts on the verifier's own time (`draft_cost` > 0; a remote
        source's drafts are free here and `fit_batch` weighs their rows).

        Why: every sequence of the batch waits while one drafts in process, so a draft token
        must buy more than the batch's plain rate, not the solo one. With every sequence doing
        alike, a sequence's rate is `expected_tokens(j) / (T / B + d j)`: T the batch's plain
        forward (`batch_cost(B)`), d the drafting cost per token (the draft rows' own cost is
        `fit_batch`'s to weigh, after drafting). At B = 1 the solo choice stands; at B = 8 on
        a CPU an int8 drafter (16 ms a token) stops drafting, since a plain batched step
        already commits a token per ~21 ms (measured: in-process int8 drafts at c >= 4 cut
        `bench serve` to 0.6x batched plain), while an n-gram drafter (microseconds) keeps k.
        `key`: the draft's class key (`class_key`) its acceptance is judged by, where not
        `name` (the drafting cost is the source's)."""
        d = self.draft_cost(name)
        if sequences <= 1 or d <= 0 or k <= 0:
            return k
        key = key or name
        share = self.batch_cost(sequences) / sequences
        a = self.batch_acceptance(key)
        best_j, best = 0, 1.0 / share * self.margin  # a draft must beat plain by the margin
        for j in range(1, k + 1):
            rate = self.expected_tokens(j, key, a) / (share + d * j)
            if rate > best:
                best_j, best = j, rate
        return best_j

    def probe_length(self) -> int:
        """A probe's draft length: the k (up to `probe_k`) with the best committed tokens per
        second of verify at the prior acceptance, from the learnt verify curve. Why not a fixed
        length: what a probe costs is the curve's rise. Where one extra row costs nearly a whole
        forward and later rows little (torch's matmul on a CPU: 2 tokens 1.7x one, 7 tokens
        1.9x) the best probe is long; where rows are cheap and rise steadily (the few-row kernel:
        2 tokens 1.18x, 7 tokens 1.6x) it is 2-3 tokens, and a useless source's probes cost half
        as much (a probe every 8-32 plain steps is most of what such a source costs)."""
        a = min(self.prior_acceptance, 0.999)
        best = max(range(1, max(1, min(self.max_k, self.probe_k)) + 1),
                   key=lambda k: (1 - a ** (k + 1)) / (1 - a) / self.verify_cost(k + 1))
        return best

    def probe_wait(self, name: str = POOLED) -> float:
        """The longest a probe of `name` may wait for its drafts: `probe_share` of the plain
        steps since its last probe, so a source no wait pays for costs the verifier at most
        that share of its time however slow it is. Why: a probe used to wait twice its
        announcement, and next to a 7 ms quantized verifier an int8 proposer announcing tens
        of milliseconds took every 8-32 steps back (0.55-0.68x plain, 2026-11-28). A source
        slower than that cap is judged only on drafts that arrive in time on their own."""
        est = self._source(name)
        return self.probe_share * est.probe_interval * self.verify_cost(1)

    def wait_pays(self, name: str, k: int, wait_s: float) -> bool:
        """Whether waiting `wait_s` for k of `name`'s drafts beats a plain step now: expected
        committed tokens per second of (wait + verify) against one token per plain verify."""
        return self.top_up_pays(name, 0, k, wait_s)  # nothing now: a plain step's one token

    def top_up_pays(self, name: str, have: int, k: int, wait_s: float) -> bool:
        """Whether waiting `wait_s` for k of `name`'s drafts beats verifying the `have` it
        offers now (committed tokens per second of wait + verify, with the usual margin); k is
        cut to what `name` has brought after waits so far."""
        k = min(k, self.delivered(name, k))
        if k <= have or wait_s < 0:
            return False
        now = self.expected_tokens(have, name) / self.verify_cost(have + 1)
        later = self.expected_tokens(k, name) / (wait_s + self.verify_cost(k + 1))
        return later > self.margin * now

    def delivered(self, name: str, default: int) -> int:
        """Draft tokens `name` is expected to bring after a wait (`default` before any wait).
        Never below one: a source whose waits brought nothing lately must stay worth a wait
        when it is fast, or the estimate could never recover (n-gram drafts come and go with
        what the output quotes)."""
        got = self._delivered.get(name)
        return default if got is None else max(1, round(got))

    def select(self, values: Sequence[float], forced: Sequence[bool]) -> list[int]:
        """Draft nodes (1-based tree indices) worth one forward, best first, prefix-closed.

        `values[i]` is node i's chance of ending on the accepted path (`values[0]`, the pending
        token, is ignored); `forced[i]` keeps node i whatever it is worth (a probe's chain,
        whose parents are forced too). Ties go to the older node, which is never a descendant
        of a newer one, and a child is never worth more than its parent, so every prefix of the
        order is a tree.
        """
        nodes = range(1, len(values))
        must = [i for i in nodes if forced[i]]
        rest = sorted((i for i in nodes if not forced[i]), key=lambda i: (-values[i], i))
        gain = 1.0 + sum(values[i] for i in must)
        best_n, best_rate = 0, gain / self.verify_cost(1 + len(must))
        if not must:
            best_rate *= self.margin
        for n, i in enumerate(rest, start=1):
            gain += values[i]
            rate = gain / self.verify_cost(1 + len(must) + n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return sorted(must + rest[:best_n])

    def fit_batch(self, plans: Sequence[tuple[Sequence[float], Sequence[bool]]], *,
                  fixed_rows: int, tokens: int, prompt_rows: int = 0) -> list[list[int]]:
        """Draft nodes (1-based, ascending) each planned tree keeps in a batched forward.

        `plans[s] = (values, forced)` is one sequence's planned tree as `select` takes it;
        `fixed_rows` counts every other decode row the forward feeds (each sequence's pending
        token, other sequences' trees), `prompt_rows` the prompt rows riding along, and
        `tokens` the sequences whose time the step takes (running ones, each committing a
        token without drafts, and new ones whose prompt runs or waits). Like `select` for one
        tree: the batch's draft nodes are taken best first (forced ones always; each tree
        stays prefix-closed) and cut where `(tokens + sum of values) / cost` is highest. So a
        draft row is kept only while what it buys beats its marginal cost at this load: all
        of them when rows are nearly free, none but probes when every row costs a full share.

        The cost is the decode step's (`batch_cost` of the decode rows) plus what the draft
        rows add where they really sit, on top of the prompt rows. Prompt rows are the prompts'
        own cost: judged against a step they lengthen, drafts looked nearly free and rode every
        prefill step, delaying each prompt in it or waiting for it (TTFT under load), for
        tokens worth a decode step's share."""
        on_top = fixed_rows + prompt_rows

        def cost(rows: int) -> float:  # rows: decode rows, draft nodes included
            if not prompt_rows:
                return self.batch_cost(rows)
            return (self.batch_cost(fixed_rows) + self.batch_cost(rows + prompt_rows)
                    - self.batch_cost(on_top))

        rows, gain, rest = fixed_rows, float(tokens), []
        keep: list[list[int]] = [[] for _ in plans]
        for s, (values, forced) in enumerate(plans):
            for i in range(1, len(values)):
                if forced[i]:
                    keep[s].append(i)
                    rows += 1
                    gain += values[i]
                else:
                    rest.append((-values[i], s, i))
        rest.sort()
        best_n, best_rate = 0, gain / cost(rows)
        for n, (neg, _, _) in enumerate(rest, start=1):
            gain -= neg
            rate = gain / cost(rows + n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        for _, s, i in rest[:best_n]:
            keep[s].append(i)
        return [sorted(k) for k in keep]

    # ---- observations -----------------------------------------------------------------------
    def record_verify(self, fed: int, seconds: float) -> None:
        self._verify[fed] = ema(self._verify.get(fed), seconds)

    def record_batch(self, rows: int, seconds: float) -> None:
        """A batched forward (several sequences) fed `rows` rows in all in `seconds`."""
        self._batch[rows] = ema(self._batch.get(rows), seconds)

    def record_draft(self, drafted: int, seconds: float, name: str = POOLED) -> None:
        """`name` spent `seconds` of the verifier's time drafting `drafted` tokens."""
        if drafted <= 0:
            return
        keep_newest(self._draft, name, ema(self._draft.get(name), seconds / drafted), MAX_RECORDS)

    def record_delivered(self, name: str, tokens: int, asked: int) -> None:
        """After a wait for `name`, asked for `asked`, it offered `tokens` (its longest
        candidate). A full answer only says `name` can bring at least that many, so it never
        lowers the estimate (a short ask must not cap later, longer ones)."""
        old = self._delivered.get(name)
        if old is not None and tokens >= asked and old > tokens:
            return
        keep_newest(self._delivered, name, ema(old, tokens), MAX_RECORDS)

    def record_unheard(self, name: str = POOLED, streams: bool = False) -> None:
        """`name` was asked for drafts and none of its tokens is in this step's tree;
        `streams`: its drafts arrive when they arrive (`DraftSource.streams`), so it may have
        been too late (`choose_k`: late) rather than empty-handed."""
        est = self._source(name)
        est.unheard += 1
        est.streams = est.streams or streams

    def record_acceptance(self, drafted: int, accepted: int, name: str = POOLED) -> None:
        """`name`'s deepest offered chain was `drafted` long; its first `accepted` tokens were
        right (the token after them, if any, was wrong)."""
        if drafted <= 0:
            return
        est = self._source(name)
        est.unheard, est.late = 0, False
        self._late.pop(name, None)
        if est.probing:  # failed probes back off exponentially, a hit resets the interval
            est.probing = False
            backoff = min(2 * est.probe_interval, self.max_probe_every)
            est.probe_interval = self.probe_every if accepted else backoff
        trials = accepted + (1 if accepted < drafted else 0)
        # each judged token (the accepted ones and the first wrong one) counts for its own
        # class along the chain (`chain_acceptance`), each class once per block
        counts: dict[str, list[float]] = {}
        for j, key in enumerate(_ladder(name, trials)):
            c = counts.setdefault(key, [0.0, 0.0])
            c[0] += j < accepted
            c[1] += 1
        for key, (ok, n) in counts.items():
            _observe(self._source(key), ok, n)
            rec = self._longrun.get(key) or [0.0, 0.0]
            rec[0] = _LONG_DECAY * rec[0] + ok
            rec[1] = _LONG_DECAY * rec[1] + n
            keep_newest(self._longrun, key, rec, MAX_RECORDS)
        source = _source_of(name)
        if source is not None:  # a class's drafts count for its source's phase too
            _observe(self._source(source), accepted, trials)


class _VerifyPoints(dict):
    """Verify seconds by fed-token count (EMA), and the curve between them, fitted once per
    change. Why: the planner reads `verify_cost` for every k it weighs, ~40 times a step, and
    refitting the line each time took most of a step's planning (0.4 ms a step where nothing
    was drafted, 3 % of a quantized step on open-ended text). Every write drops the fit and
    the ordered points (`ordered`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._line: tuple[tuple[float, ...], float, float] | None = None
        self._ordered: dict[int, float] | None = None

    def line(self, prior_jump: float, prior_slope: float) -> tuple[float, ...]:
        """(c1, x0, y0, slope, floor): one token costs c1, n >= 2 tokens
        max(y0 + slope (n - x0), floor).

        One token and several tokens take different kernel paths (on CPU, 2 tokens cost ~1.6x
        one, then each further token only ~2-3 %), so n = 1 is its own point and n >= 2 is a
        straight line fitted to the measured multi-token forwards; with one such point, a
        line through it at the prior's slope; with none, the prior's jump and slope."""
        if self._line is not None and self._line[1:] == (prior_jump, prior_slope):
            return self._line[0]
        c1 = self.get(1)
        multi = {m: c for m, c in self.items() if m >= 2}
        if c1 is None:
            c1 = (min(multi.values()) / prior_jump) if multi else 1.0
        if len(multi) >= 2:
            xs, ys = zip(*multi.items(), strict=True)
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
            fit = (c1, mx, my, max(slope, 0.0), c1)
        elif multi:
            ((m, cm),) = multi.items()
            fit = (c1, m, cm, prior_slope * c1, c1)
        else:
            fit = (c1, 2, c1 * prior_jump, c1 * prior_slope, float("-inf"))
        self._line = (fit, prior_jump, prior_slope)
        return fit

    def ordered(self) -> dict[int, float]:
        """The multi-token points made non-decreasing in the count fed (pool adjacent
        violators, as `CostModel.batch_cost` does): a row never saves time. Why: each point is
        an EMA of a few forwards on a loaded machine, and one slow sample (a 9-row forward at
        29.8 ms beside a 10-row one at 26.6 ms, seen on the agent trace) made the planner
        stop a 0.99-acceptance chain short of it, step after step."""
        if self._ordered is None:
            xs = sorted(m for m in self if m >= 2)
            self._ordered = dict(zip(xs, _non_decreasing([self[x] for x in xs]), strict=True))
        return self._ordered

    def _changed(self) -> None:
        self._line = self._ordered = None

    def __setitem__(self, key: int, value: float) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key: int) -> None:
        super().__delitem__(key)
        self._changed()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def pop(self, *args: Any) -> Any:
        self._changed()
        return super().pop(*args)

    def popitem(self) -> tuple[int, float]:
        self._changed()
        return super().popitem()

    def setdefault(self, key: int, default: float | None = None) -> Any:
        self._changed()
        return super().setdefault(key, default)

    def clear(self) -> None:
        super().clear()
        self._changed()


def keep_newest(record: dict, key: Any, value: Any, limit: int) -> None:
    """`record[key] = value` as its newest entry; past `limit` entries the least recently
    kept dropped. For the records a verifier's sequences share for its whole life (these
    sources', the grammar's), keyed by what peers and requests bring."""
    record.pop(key, None)
    record[key] = value
    while len(record) > limit:
        del record[next(iter(record))]


def _observe(est: _SourceEstimate, accepted: float, trials: float) -> None:
    """One block's judged tokens into a generation's estimate (older blocks decayed)."""
    est.observed += 1
    est.seed_weight *= _DECAY
    est.acc = _DECAY * est.acc + accepted
    est.trials = _DECAY * est.trials + trials


def _non_decreasing(ys: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]
    return [m for m, c in blocks for _ in range(int(c))]
