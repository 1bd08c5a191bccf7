"""Cross-engine handoffs end to end, and the demo's models and runners."""
