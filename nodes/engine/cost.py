"""The one cost model: how many draft nodes a verify forward is worth, from measured costs.

Used by the engine for every step (chain or tree) and meant for remote proposers' budgeting too
(`nodes/roles/remote_draft.py` can drop its own estimator for this one).

Expected tokens committed by a block with k drafts at per-token acceptance a is
E(k) = (1 - a^(k+1)) / (1 - a). We pick the k maximising E(k) / (verify(k+1) + draft(k)),
where k = 0 is a plain decode step. Verify cost is learnt per fed-token count (it is strongly
sublinear on CPU), draft cost per drafted token. When speculation does not pay we decode plainly
and re-probe now and then (backing off while probes keep failing) so a drafter that starts
agreeing (e.g. the output begins to quote the input) is picked up again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_DECAY = 0.7  # weight of history per block: acceptance comes in phases (copying or not)
_EMA = 0.3


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
    #: a probe's draft length: on CPU a few more tokens cost little once n >= 2
    probe_k: int = 6
    _acc: float = 0.0
    _trials: float = 0.0
    _verify: dict[int, float] = field(default_factory=dict)  # fed tokens -> EMA seconds
    #: seconds per drafted token (EMA) under key "per_token"; a dict so forks share it
    _draft: dict[str, float] = field(default_factory=dict)
    _plain_streak: int = 0
    _probing: bool = False
    _probe_interval: int = 8
    #: source name -> [decayed accepted, decayed offered] draft tokens
    _sources: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.start_generation()

    def start_generation(self) -> None:
        """Forget acceptance (it belongs to the previous prompt); keep the learnt costs."""
        self._probe_interval = self.probe_every
        self._plain_streak = 0
        self._probing = False
        # the prior is decayed like any observation, so evidence soon outweighs it
        self._acc = self.prior_acceptance * self.prior_weight
        self._trials = self.prior_weight

    def fork(self) -> CostModel:
        """A per-sequence model: fresh acceptance; verify and draft costs shared with this one
        (they belong to the backend, device and drafter, not to a prompt)."""
        other = CostModel(
            max_k=self.max_k, min_k=self.min_k, probe_every=self.probe_every,
            max_probe_every=self.max_probe_every, prior_acceptance=self.prior_acceptance,
            prior_weight=self.prior_weight, prior_jump=self.prior_jump,
            prior_slope=self.prior_slope, margin=self.margin, probe_k=self.probe_k,
        )
        other._verify = self._verify
        other._draft = self._draft
        return other

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        return self._acc / self._trials

    def verify_cost(self, n: int) -> float:
        """Seconds for a verifier forward over n tokens, learnt.

        One token and several tokens take different kernel paths (on CPU, 2 tokens cost ~1.6x
        one, then each further token only ~2-3 %), so n = 1 is its own point and n >= 2 is a
        straight line fitted to the measured multi-token forwards.
        """
        if n in self._verify:
            return self._verify[n]
        c1 = self._verify.get(1)
        multi = {m: c for m, c in self._verify.items() if m >= 2}
        if c1 is None:
            c1 = (min(multi.values()) / self.prior_jump) if multi else 1.0
        if n == 1:
            return c1
        per_token = self.prior_slope * c1
        if len(multi) >= 2:
            xs, ys = zip(*multi.items(), strict=True)
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
            return max(my + max(slope, 0.0) * (n - mx), c1)
        if multi:
            ((m, cm),) = multi.items()
            return max(cm + per_token * (n - m), c1)
        return c1 * (self.prior_jump + self.prior_slope * (n - 2))

    def expected_rate(self, k: int) -> float:
        """Committed tokens per second expected from a block with k drafts."""
        a = min(self.acceptance, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        cost = self.verify_cost(k + 1) + self._draft.get("per_token", 0.0) * k
        return tokens / cost

    def choose_k(self) -> int:
        """Draft length for the next block; 0 means a plain step."""
        best_k = max(range(self.min_k, self.max_k + 1), key=self.expected_rate)
        # demand a margin: costs are noisy, and a wrong "yes" costs more than a wrong "no"
        if self.expected_rate(best_k) > self.margin * self.expected_rate(0):
            self._plain_streak = 0
            self._probing = False
            return best_k
        self._plain_streak += 1
        if self._plain_streak >= self._probe_interval:
            self._plain_streak = 0
            self._probing = True
            return min(self.max_k, self.probe_k)
        return 0

    def record_verify(self, fed: int, seconds: float) -> None:
        old = self._verify.get(fed)
        self._verify[fed] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def record_draft(self, drafted: int, seconds: float) -> None:
        if drafted <= 0:
            return
        per = seconds / drafted
        old = self._draft.get("per_token")
        self._draft["per_token"] = per if old is None else (1 - _EMA) * old + _EMA * per

    def record_acceptance(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        if self._probing:  # failed probes back off exponentially, a hit resets the interval
            self._probing = False
            backoff = min(2 * self._probe_interval, self.max_probe_every)
            self._probe_interval = self.probe_every if accepted else backoff
        trials = accepted + (1 if accepted < drafted else 0)
        self._acc = _DECAY * self._acc + accepted
        self._trials = _DECAY * self._trials + trials

    def record_source(self, name: str, offered: int, accepted: int) -> None:
        """How one source's proposals fared in a step (tokens placed in the tree / accepted)."""
        if offered <= 0:
            return
        acc, off = self._sources.get(name, [0.0, 0.0])
        self._sources[name] = [_DECAY * acc + accepted, _DECAY * off + offered]

    def source_acceptance(self, name: str) -> float | None:
        """Recent fraction of a source's tree tokens that ended on the accepted path."""
        got = self._sources.get(name)
        return got[0] / got[1] if got and got[1] > 0 else None


#: the old name (nodes.engine.adaptive); same object
DraftLengthController = CostModel
