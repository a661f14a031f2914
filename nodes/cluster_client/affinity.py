"""Which verifier already holds a prompt's beginning, so that a conversation's next turn goes
back to the verifier that served the last one.

Why: a verifier keeps finished generations' K/V (nodes/engine/prefix_cache.py) and starts a
prompt that begins the same way from them, so a conversation's tenth turn prefills only its
newest message there, and the whole conversation on any other verifier. Least-loaded choice
alone sends a turn to whichever verifier is freest: with several verifiers busy with other
users, a turn found its conversation 1/N of the time. SGLang's router and vLLM's production
stack route by prefix for the same reason.

What it keeps: for each generation this client saw finish with its prompt's token ids known
(the gateway and `specbus generate` tokenize when they can; failover needs the ids too), the
ids of prompt + output and the verifier that produced the last of them. At most `MAX_ENTRIES`
generations of at most `MAX_TOKENS` ids each; the least recently used go first, and a newer
one that extends an older one replaces it (a conversation keeps one entry). It guesses the
verifiers' caches (it cannot see their evictions): a wrong guess costs only the prefill the
least-loaded choice would have cost anyway.

How the choice uses it (`Balancer.take`): the verifier holding the longest prefix of at least
`MIN_TOKENS` ids is taken when it has room and its load is at most `SLACK` above the least
loaded candidate's (one more sequence in a batch costs little next to a prefill of hundreds of
positions); otherwise the least loaded, as without it. Used under the balancer's lock only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from nodes.prefixes import as_ids, common_prefix, longest

MAX_ENTRIES = 512  # generations remembered (a client cannot grow it without bound)
MAX_TOKENS = 16384  # ids kept per generation (beyond: a prefix of them)
MIN_TOKENS = 32  # a shorter common prefix (a chat template's header) is no reason to prefer
SLACK = 2  # a preferred verifier may carry this many more sequences than the least loaded


class PrefixAffinity:
    """Recent generations' token ids and their verifiers (module docstring)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[str, object]] = OrderedDict()  # oldest first
        self._next = 0
        self.routed = 0  # generations sent to the verifier holding their prefix

    def __len__(self) -> int:
        return len(self._entries)

    def holder(self, prompt_ids: Sequence[int]) -> str | None:
        """The verifier that holds the longest prefix of `prompt_ids` (at least MIN_TOKENS
        ids, all but the last), or None."""
        want = as_ids(prompt_ids)
        key, n = longest(((k, ids) for k, (_, ids) in self._entries.items()), want,
                         len(want) - 1)
        if key is None or n < MIN_TOKENS:
            return None
        self._entries.move_to_end(key)
        return self._entries[key][0]

    def served(self, token_ids: Sequence[int], node_id: str) -> None:
        """`node_id` produced the last of `token_ids` (prompt + output): it holds them."""
        ids = as_ids(token_ids[:MAX_TOKENS])
        if len(ids) < MIN_TOKENS:
            return
        for key, (_, kept) in list(self._entries.items()):
            if common_prefix(kept, ids) == len(kept):
                del self._entries[key]  # the new one extends it (or repeats it)
        self._entries[self._next] = (node_id, ids)
        self._next += 1
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
