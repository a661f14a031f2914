"""Membership: mDNS announce/browse, capability cards, heartbeats and failure detection."""
