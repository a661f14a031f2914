"""Refutation: keeping our own incarnation ahead of every plausible claim about us.

Peers judge us by the incarnation on our card. When one of them suspects us, announces our
leave, or holds a card of ours from a later incarnation (an older run of ours, restarted with
a lost counter file), the only answer that wins is a higher incarnation (SWIM's refutation,
memberlist's `refute`). Why a class of its own: the bump is persisted and bounded, so it is
rate-limited and range-checked in one place, whichever message provoked it; a forged message
must never push the persisted incarnation out of range or burn it quickly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from bus.loop import IOLoop
from discovery.announcer import Announcer
from discovery.cards import Card
from discovery.counters import Counters
from discovery.identity import Identity, IncarnationExhausted
from discovery.limits import MAX_COUNTER, is_plausible_step
from discovery.view import LocalView

log = logging.getLogger("discovery.membership")


class Refuter:
    """Answers claims about us with a higher incarnation (I/O thread only)."""

    def __init__(self, loop: IOLoop, view: LocalView, identity: Identity,
                 announcer: Announcer, counters: Counters, heartbeat_s: float) -> None:
        self.loop = loop
        self.view = view
        self.identity = identity
        self.announcer = announcer
        self._counters = counters
        self._heartbeat_s = heartbeat_s
        self._last_refute = -1e9
        self._deferred_claim: int | None = None  # a claim to refute once the rate limit allows
        self._deferred_reason = ""  # why (the latest deferred claim's reason)

    def refute(self, at_least: int, reason: str = "a claim about us") -> None:
        """Someone thinks we are suspect (or knows a later incarnation of us): outgrow it.

        Bumps to max(own, at_least) + 1, at most once per heartbeat interval (one bump is
        enough; more only burn incarnations), and only for a claim a node of ours could have
        made: within MAX_JUMP of our incarnation (a restart with a lost counter file is one
        step per earlier start) and below MAX_COUNTER. Anything else is hostile: dropped.
        Every bump is logged as a warning with `reason` (who claimed what), so a node's log
        says why its incarnation rose (issue 47).
        """
        own = self.view.own.incarnation
        if not is_plausible_step(own, at_least) or max(own, at_least) >= MAX_COUNTER:
            self._counters.inc("hostile")
            log.debug("ignoring an implausible claim of our incarnation: %d (ours %d)",
                      at_least, own)
            return
        now = time.monotonic()
        wait = self._last_refute + self._heartbeat_s - now
        if wait > 0:  # too soon: one deferred refutation covers every claim until then
            if self._deferred_claim is None:
                self.loop.call_later(wait, self._deferred_refute)
            self._deferred_claim = max(self._deferred_claim or 0, at_least)
            self._deferred_reason = reason
            return
        try:
            new = self.identity.bump(at_least)
        except (IncarnationExhausted, OSError) as exc:
            log.warning("cannot refute: %s", exc)
            return
        self._last_refute = now
        self._counters.inc("refutations")
        log.warning("raising our incarnation %d -> %d to refute %s", own, new, reason)
        card = self.view.own
        self.announcer.set_card(replace(card, incarnation=new, version=card.version + 1))

    def on_own_card(self, card: Card) -> None:
        """A card of ours from elsewhere (gossip, a snapshot): stay ahead of it."""
        if card.incarnation > self.view.own.incarnation:
            self.refute(card.incarnation, f"a card of ours at incarnation {card.incarnation} "
                        "(an earlier run of this node, its counter file lost?)")

    def on_own_heartbeat(self, incarnation: int, version: int) -> None:
        """A heartbeat claiming to be us: another process or an old run. Stay ahead of it."""
        own = self.view.own
        if incarnation > own.incarnation:
            self.refute(incarnation, f"a heartbeat in our name at incarnation {incarnation} "
                        "(another process with our id, or an earlier run)")
        elif incarnation == own.incarnation and not is_plausible_step(own.version, version):
            self._counters.inc("hostile")

    def on_own_leave(self, incarnation: int) -> None:
        """Someone announces our leave: outgrow that incarnation so peers take us back."""
        if incarnation >= self.view.own.incarnation:
            self.refute(incarnation, f"a leave announced in our name at incarnation "
                        f"{incarnation}")

    def _deferred_refute(self) -> None:
        claim, self._deferred_claim = self._deferred_claim, None
        if claim is not None and claim >= self.view.own.incarnation and not self.announcer.left:
            self.refute(claim, self._deferred_reason)  # not outgrown meanwhile
