"""The SGLang decode server that ``run_demo``'s TensorRT-LLM -> SGLang flow starts
(``kvbridge.demo.run.sglang_decode_server``), started once for a module and shared by its
TensorRT-LLM -> SGLang runs instead of one per run.

- ``sglang_decode``: ``get(model_dir) -> (Server, bootstrap port)``; one server per model.
"""
import pytest


@pytest.fixture(scope="module")
def sglang_decode(tmp_path_factory):
    """``get(model_dir)``: the module's running SGLang decode of ``model_dir`` (started on first use)."""
    import contextlib

    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)

    from kvbridge.demo.run import sglang_decode_server

    with contextlib.ExitStack() as stack:
        running = {}

        def get(model_dir):
            if model_dir not in running:
                log_dir = tmp_path_factory.mktemp("sglang-decode")
                running[model_dir] = stack.enter_context(sglang_decode_server(model_dir, log_dir=log_dir))
            srv, _ = running[model_dir]
            assert srv.alive(), f"the shared SGLang decode exited:\n{srv.log_tail(40)}"
            return running[model_dir]

        yield get
