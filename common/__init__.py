"""kvbridge.common: the transfer core (transport, protocol, handoff, cost model, metrics). Imports no engine."""
