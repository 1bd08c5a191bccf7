"""Hostile peers against the handoff protocol, and what the Mooncake engine exposes."""
