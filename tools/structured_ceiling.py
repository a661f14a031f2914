"""What a constrained request's draft sources allow at best: the oracle ceiling of a row of
`specbus bench structured`.

Why: issue 46's extraction and agent targets were missed with the reason "the model invents the
values, and nothing drafts an invented value". That is a claim about the drafts' content, which
a measured speedup cannot separate from how well the engine judged them. Replayed offline over
constrained plain's own answer (greedy: every configuration writes the same tokens), the
engine's sources for a configuration are asked at every step what they propose (the grammar's
forced paths, the ngram or suffix drafter's chain and alternatives, at most the engine's max
draft), and an oracle verifier feeds only the longest proposed path the answer takes, paying
the verify cost of that many rows (a plain step where none is right). No engine with those
sources does better (every real step feeds at least the accepted path), so a ceiling below a
target says the sources' content cannot reach it on this model's answers. Beside it the
perfect drafter: every step commits the engine's whole max draft plus one, the most any
content could give with this verifier's step.

End to end (what the targets count): the request's measured time to its first token (the
prefill, from the bench's constrained plain runs: a prefix cache hit included) plus the
modelled decode, against the same first token plus plain steps. The replay itself is
`tools.trace_ceiling.replay_sources`, the suffix work's oracle over engine sources. Costs come from
`tools.trace_ceiling.measure_costs` on the request's prompt; the context's growth over the
answer and the grammar's mask (1-2 % of a step, the bench's `mask %`) are left out of both.
"""

from __future__ import annotations

from collections.abc import Callable

from tools.trace_ceiling import Ceiling


def perfect(answer_len: int, verify_cost: Callable[[int], float], max_k: int) -> Ceiling:
    """The perfect drafter over an answer of `answer_len` tokens: every step after the first
    token commits `max_k` drafts plus the model's own (the last step what is left)."""
    steps, left = [], max(0, answer_len - 1)
    while left > 0:
        steps.append(min(max_k + 1, left))
        left -= steps[-1]
    return Ceiling(max(0, answer_len - 1) * verify_cost(1),
                   sum(verify_cost(s) for s in steps), answer_len, tuple(steps))


def end_to_end(c: Ceiling, first_s: float) -> float:
    """The ceiling's speedup with the request's time to its first token on both sides."""
    return (first_s + c.plain_s) / (first_s + c.drafted_s) if first_s + c.drafted_s > 0 else 1.0
