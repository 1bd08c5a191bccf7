"""The kvbridge SGLang backend's bootstrap server (one per prefill instance)."""

from __future__ import annotations

import json

from aiohttp import web

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from kvbridge.common.bootstrap import ranks_payload

__all__ = ["KVBridgeKVBootstrapServer"]


class KVBridgeKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap server, started once per prefill instance by
    ``start_disagg_service`` (tokenizer side), plus each rank's kvbridge record: returned
    with the rank's ``GET /route`` answer and listed at ``GET /kvbridge/ranks``."""

    def __init__(self, host: str, port: int):
        self.kvbridge_ranks: dict[tuple[int, int, int, int], dict] = {}
        super().__init__(host, port)

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_get("/kvbridge/ranks", self._handle_kvbridge_ranks)

    async def _handle_route_put(self, request: web.Request):
        data = await request.json()  # aiohttp caches the body; Common reads it again
        resp = await super()._handle_route_put(request)
        rec = data.get("kvbridge")
        if resp.status == 200 and isinstance(rec, dict):
            dp = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
            key = (int(dp), int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
            async with self.lock:
                self.kvbridge_ranks[key] = {**rec, "rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"])}
        return resp

    async def _handle_route_get(self, request: web.Request):
        resp = await super()._handle_route_get(request)
        if resp.status != 200:
            return resp
        q = request.query
        try:
            key = tuple(int(q[k]) for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"))
        except (KeyError, ValueError):
            return resp
        if key == (-1, -1, -1, -1):
            # The server-wide answer (parsed strictly: PrefillServerInfo(**data)). Page size
            # and KV dtype are left out: SGLang's decode refuses (raises) when they differ
            # from its own, but kvbridge bridges page sizes and checks dtypes per request,
            # from each rank's layout (its record below), naming what differs.
            body = json.loads(resp.body)
            body["page_size"] = None
            body["kv_cache_dtype"] = None
            return web.json_response(body, status=200)
        rec = self.kvbridge_ranks.get(key)
        if rec is None:
            return resp
        body = json.loads(resp.body)
        body["kvbridge"] = {k: v for k, v in rec.items() if k not in ("rank_ip", "rank_port")}
        return web.json_response(body, status=200)

    async def _handle_kvbridge_ranks(self, request: web.Request):
        async with self.lock:
            ranks = dict(self.kvbridge_ranks)
        return web.json_response(ranks_payload(
            ranks, ready=self._is_ready(), attn_tp_size=self.attn_tp_size, attn_cp_size=self.attn_cp_size,
            dp_size=self.dp_size, pp_size=self.pp_size, page_size=self.page_size, kv_cache_dtype=self.kv_cache_dtype))
