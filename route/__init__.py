"""``kvbridge route``: one OpenAI-compatible front for a mixed disaggregated deployment.

It sends each request to a prefill and a decode server of any supported engine (SGLang
on the kvbridge backend, TensorRT-LLM and vLLM with their kvbridge connectors), each in its own
request shape with the kvbridge handle where that engine carries it, or straight to a
server that computes it alone when the cost model says moving the KV is not worth it.

| module | job |
|---|---|
| ``config`` | ``route.yaml``: servers by engine and role, links per pair, deadlines, retries, limits |
| ``pool`` | servers' health and load; least-outstanding choice of pairs and compute targets |
| ``capabilities`` | what each server can do (sampling, seed, stop strings, EOS, context) and what a request needs |
| ``gates`` | the cost gate of each pair's link |
| ``engines`` | each engine's request shapes and calls (SGLang ``/generate``, trtllm-serve ``/v1/completions`` + announce, vLLM ``/v1/completions`` + ``kv_transfer_params``) |
| ``ranks`` | a prefill's kvbridge ranks: their endpoints (announced to TensorRT-LLM decodes, given to vLLM decodes of a bus-only prefill) and room aborts |
| ``dispatch`` | one request: choose, hand off or compute, retry, stream |
| ``admission`` | bounded queue (429 / 503 with Retry-After) |
| ``text``, ``protocol`` | tokenizer and detokenizer; OpenAI and SGLang request/response shapes |
| ``app`` | the aiohttp application (``build_app``, ``serve``) |
| ``metrics`` | Prometheus metrics per route (engine pair) |
| ``check`` | ``--check``: probe every server |

A mixed deployment of real servers on this machine behind the router, and ``kvbridge demo
--router`` driving it, live in ``kvbridge.demo`` (``route_local``, ``route_demo``).
"""

from .config import ConfigError, RouteConfig, load_config, parse_config

__all__ = ["ConfigError", "RouteConfig", "load_config", "parse_config", "build_app", "serve", "check"]


def build_app(*args, **kw):
    """``kvbridge.route.app.build_app`` (imported on use: it loads the tokenizer stack)."""
    from .app import build_app as _b

    return _b(*args, **kw)


def serve(*args, **kw):
    from .app import serve as _s

    return _s(*args, **kw)


async def check(*args, **kw):
    from .check import check as _c

    return await _c(*args, **kw)
