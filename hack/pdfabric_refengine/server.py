"""The reference engine as a serving process, one per role, shaped like SGLang's PD servers.

    python -m pdfabric_refengine.server --role prefill|decode [--backend sglang|direct] ...

As SGLang's router drives PD today, it sends the same ``/generate`` request (``input_ids`` or
``text``, ``sampling_params.max_new_tokens``) with ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room`` to one prefill and one decode server (``router.generate`` does so). Prefill
computes the prompt's KV into its pools and sends it through the backend's sender (pd.py's
``run_prefill``: SGLang's classes after its plugin loading, or the agent's engine API with
``--backend direct``, which runs no bootstrap server and so pairs with prefill replica 0 only);
decode receives it into its own pools through the receiver, asking the prefill's bootstrap server
which replica it is, and generates greedily from the pages alone; its
answer is SGLang's: ``text``, ``output_ids`` and ``meta_info``. A transfer that fails or times out
answers 500 with the reason, the request's pages freed, so a dead peer costs an error, not a hang.

Everything else comes from the environment a PDCluster's engine process gets (docs/engines.md):
``PDFABRIC_PORT``, ``PDFABRIC_BOOTSTRAP_PORT``, ``PDFABRIC_TP``, ``PDFABRIC_CP``,
``PDFABRIC_SHM_DIR`` as defaults of the flags; ``PDFABRIC_AGENT_ADDRESS``,
``PDFABRIC_ENGINE_TOKEN_FILE``, ``PDFABRIC_REPLICA`` and ``PDFABRIC_RANK`` for the rank managers
(pdfabric_agent.client.engine_env.FabricConfig). ``/health`` answers once every rank is registered with its
agent (the startup and readiness probes' path).

The tokenizer is bytes: the reference model's 256 token ids are the bytes of UTF-8 text, and the
answer's text is its tokens as Latin-1 (every id a character).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from pdfabric_core.engines.launch import EngineEnv
from pdfabric_refengine.pd import Engine, open_engine

log = logging.getLogger("pdfabric_refengine.server")
VOCAB = 256
DEFAULT_MAX_NEW_TOKENS = 16


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def detokenize(ids: list[int]) -> str:
    return bytes(ids).decode("latin-1")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


class BadRequest(ValueError):
    pass


def parse_request(body: Any, role: str) -> dict[str, Any]:
    """SGLang's GenerateReqInput, the fields a PD request carries: the prompt, max_new_tokens and
    the router's bootstrap triple (greedy only: the reference engine does not sample)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    ids = body.get("input_ids")
    if ids is None:
        text = body.get("text")
        if not isinstance(text, str):
            raise BadRequest("input_ids or text is required")
        ids = tokenize(text)
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < VOCAB for t in ids):
        raise BadRequest(f"input_ids must be a non-empty list of token ids in [0, {VOCAB})")
    params = body.get("sampling_params") or {}
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(max_new, int) or max_new < 1:
        raise BadRequest("sampling_params.max_new_tokens must be a positive integer")
    if params.get("temperature", 0) not in (0, 0.0):
        raise BadRequest("the reference engine is greedy: temperature must be 0")
    room = body.get("bootstrap_room")
    if not isinstance(room, int):
        raise BadRequest("bootstrap_room is required (a PD request: the router pairs prefill and decode by it)")
    req: dict[str, Any] = {"room": room, "prompt": ids, "max_new_tokens": max_new}
    if role == "decode":
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise BadRequest("bootstrap_host and bootstrap_port are required: they name the prefill server")
        req["bootstrap"] = f"{host}:{port}"
    return req


class Server:
    def __init__(self, engine: Engine, bootstrap: str, *, workers: int = 32) -> None:
        self.engine = engine
        self.bootstrap = bootstrap  # prefill: its own bootstrap address
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="req")
        self.served = 0

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def generate(self, request: web.Request) -> web.Response:
        try:
            req = parse_request(await request.json(), self.engine.role)
        except BadRequest as exc:
            return web.json_response({"error": {"message": str(exc), "code": 400}}, status=400)
        except ValueError as exc:
            return web.json_response({"error": {"message": f"bad JSON: {exc}", "code": 400}}, status=400)
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        bootstrap = req.pop("bootstrap", self.bootstrap)
        try:
            result = await loop.run_in_executor(self.executor, self.engine.run, req, bootstrap)
        except Exception as exc:  # a pool too small for the prompt, an agent that refused: an answer
            log.exception("room %s", req["room"])
            result = {"room": req["room"], "state": "Failed", "errors": {"engine": f"{type(exc).__name__}: {exc}"}}
        meta: dict[str, Any] = {
            "id": str(req["room"]),
            "bootstrap_room": req["room"],
            "prompt_tokens": len(req["prompt"]),
            "e2e_latency": time.monotonic() - t0,
            "kv_transfer": result.get("metrics", {}),
        }
        if result["state"] != "Success":
            message = f"KV transfer of room {req['room']} failed: " + "; ".join(
                f"{k}: {v}" for k, v in sorted(result.get("errors", {}).items())
            )
            meta["finish_reason"] = {"type": "abort", "message": message}
            return web.json_response({"error": {"message": message, "code": 500}, "meta_info": meta}, status=500)
        self.served += 1
        # Prefill's part of a PD request is its first token (the KV went to decode; the router
        # answers with decode's).
        tokens = [result["first_token"]] if self.engine.role == "prefill" else result["tokens"]
        meta["completion_tokens"] = len(tokens)
        meta["finish_reason"] = {"type": "length", "length": len(tokens)}
        return web.json_response({"text": detokenize(tokens), "output_ids": tokens, "meta_info": meta})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_post("/generate", self.generate)
        return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], default=os.environ.get(EngineEnv.ROLE))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=_env_int(EngineEnv.PORT, 30000))
    ap.add_argument("--bootstrap-port", type=int, default=_env_int(EngineEnv.BOOTSTRAP_PORT, 8998))
    ap.add_argument("--tp", type=int, default=_env_int(EngineEnv.TP, 1))
    ap.add_argument("--cp", type=int, default=_env_int(EngineEnv.CP, 1))
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shm-dir", default=os.environ.get(EngineEnv.SHM_DIR) or "/dev/shm")
    ap.add_argument("--backend", choices=["sglang", "direct"], default="sglang")
    ap.add_argument("--timeout-s", type=float, default=30.0)  # a request's wait for its peer and transfer
    # cuda:0 keeps the KV pools on the engine's first GPU (its CUDA_VISIBLE_DEVICES, set by the agent).
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.role is None:
        ap.error("--role (or PDFABRIC_ROLE) is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    engine = open_engine(
        args.role, backend=args.backend, tp=args.tp, cp=args.cp, pages=args.pages, seed=args.seed,
        shm_dir=args.shm_dir, device=args.device, timeout_s=args.timeout_s,
    )  # fmt: skip
    bootstrap_server = engine.bootstrap_server(args.host, args.bootstrap_port)
    server = Server(engine, f"{args.host}:{args.bootstrap_port}")

    async def cleanup(app: web.Application) -> None:
        server.executor.shutdown(wait=False, cancel_futures=True)
        if bootstrap_server is not None:
            bootstrap_server.close()
        engine.close()  # unlinks the pools' shared-memory files

    app = server.app()
    app.on_cleanup.append(cleanup)
    ranks = ", ".join(str(getattr(m, "rank_id", k)) for k, m in engine.managers)
    log.info("%s engine (%s backend) serving on %s:%d, ranks %s", args.role, args.backend, args.host, args.port, ranks)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=2)


if __name__ == "__main__":
    main()
