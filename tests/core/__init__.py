"""Handoff state machines, transport, protocol, control channel, bootstrap discovery, settings, cost model."""
