"""The vLLM connector and layout against real vLLM (run from its own venv)."""
