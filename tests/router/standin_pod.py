"""STAND-IN for an engine pod (until ``epdserve serve`` exists): a tiny OpenAI-shaped
server with a simulated prefix cache that publishes real KV events.

Not a model: it tokenizes the prompt, pretends to prefill the uncached blocks (sleeping
``--prefill-s-per-block`` per block, one prompt at a time), keeps an LRU of ``--num-blocks`` block hashes,
publishes BlockStored/BlockRemoved through our ZmqEventPublisher and exports vLLM's
metric names. Run: ``python standin_pod.py --port P --events-port E --replay-port R --model DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from epdserve.connectors.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher


def block_hash(parent: int | None, tokens: list[int]) -> int:
    data = json.dumps([parent, tokens]).encode()
    return int.from_bytes(hashlib.sha256(b"standin" + data).digest()[-8:], "big")


class Cache:
    def __init__(self, num_blocks: int, block_size: int, publisher: ZmqEventPublisher):
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.num_blocks, self.block_size, self.publisher = num_blocks, block_size, publisher
        self.queries = self.hits = 0

    def admit(self, ids: list[int]) -> int:
        """Returns the number of uncached blocks; publishes the step's events."""
        bs, parent, hashes = self.block_size, None, []
        for i in range(len(ids) // bs):
            parent = block_hash(parent, ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            self.blocks.move_to_end(hashes[hit])
            hit += 1
        self.queries += len(ids)
        self.hits += hit * bs
        events = []
        new = hashes[hit:]
        while new and len(self.blocks) + len(new) > self.num_blocks and self.blocks:
            events.append(BlockRemoved([self.blocks.popitem(last=False)[0]], "GPU", 0))
        new = new[: self.num_blocks]
        for h in new:
            self.blocks[h] = None
        if new:
            parent_hash = hashes[hit - 1] if hit else None
            toks = ids[hit * bs : (hit + len(new)) * bs]
            events.append(
                BlockStored(new, parent_hash, toks, bs, None, "GPU", None, [None] * len(new), 0)
            )
        self.publisher.publish(events)
        return len(hashes) - hit


def build(args) -> FastAPI:
    model = Path(args.model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string((model / "chat_template.jinja").read_text())
    publisher = ZmqEventPublisher(
        f"tcp://*:{args.events_port}", f"tcp://*:{args.replay_port}", f"kv@{args.port}"
    )
    cache = Cache(args.num_blocks, args.block_size, publisher)
    state = {"running": 0, "requests": 0, "pretokenized": 0}
    busy = asyncio.Lock()  # one prefill at a time, like an engine's step loop
    app = FastAPI(on_shutdown=[publisher.close])

    def prompt_ids(path: str, body: dict) -> list[int]:
        processed = body.get("processed_prompt")
        if isinstance(processed, dict):
            state["pretokenized"] += 1  # processed upstream: nothing to render here
            return processed["prompt_token_ids"]
        if path.endswith("chat/completions"):
            text = template.render(messages=body["messages"], add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False).ids
        prompt = body["prompt"]
        return prompt if isinstance(prompt, list) else tok.encode(prompt).ids

    def bad_request(message: str) -> JSONResponse:
        error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        return JSONResponse({"error": error}, status_code=400)

    async def generate(request: Request, path: str) -> Response:
        state["requests"] += 1
        await asyncio.sleep(args.hang_s)  # a request that wedges the pod
        if args.fail_status:
            extra = {"Retry-After": args.retry_after} if args.retry_after else None
            return JSONResponse(
                {"error": "stand-in told to fail"}, status_code=args.fail_status, headers=extra
            )
        try:  # like the engine: malformed or mistyped bodies get a 400
            body = json.loads(await request.body())
            ids = prompt_ids(path, body)
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
            return bad_request(f"bad request body: {type(exc).__name__}")
        state["running"] += 1
        try:
            async with busy:
                await asyncio.sleep(cache.admit(ids) * args.prefill_s_per_block)
        finally:
            state["running"] -= 1
        n = int(body.get("max_tokens", 4))
        kind = "chat.completion" if "chat" in path else "text_completion"
        if not body.get("stream"):
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "total_tokens": len(ids) + n,
            }
            return JSONResponse(
                {
                    "id": "x",
                    "object": kind,
                    "pod": args.port,
                    "authorization": request.headers.get("authorization"),
                    "usage": usage,
                    "choices": [{"index": 0, "text": " tok" * n}],
                }
            )

        async def chunks():
            for i in range(n):
                yield f"data: {json.dumps({'object': kind + '.chunk', 'pod': args.port, 'i': i})}\n\n"
                await asyncio.sleep(args.token_s)
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        state["requests"] += 1
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "pod": args.port}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        state["requests"] += 1
        try:
            body = json.loads(await request.body())
            ids = tok.encode(body["prompt"]).ids
        except (ValueError, RecursionError, KeyError, TypeError) as exc:
            return bad_request(f"bad request body: {type(exc).__name__}")
        return {"tokens": ids, "count": len(ids), "pod": args.port}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state["requests"] += 1
        try:
            return {"prompt": tok.decode(json.loads(await request.body())["tokens"])}
        except (ValueError, RecursionError, KeyError, TypeError) as exc:
            return bad_request(f"bad request body: {type(exc).__name__}")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset():
        from epdserve.connectors.kv_events import AllBlocksCleared

        cache.blocks.clear()
        publisher.publish([AllBlocksCleared()])
        return {"success": True}

    @app.get("/metrics")
    async def metrics():
        labels = '{engine="0",model_name="tiny"}'
        usage = len(cache.blocks) / cache.num_blocks
        lines = [
            f"vllm:num_requests_running{labels} {float(state['running'])}",
            f"vllm:num_requests_waiting{labels} 0.0",
            f"vllm:kv_cache_usage_perc{labels} {usage}",
            f"vllm:prefix_cache_queries_total{labels} {float(cache.queries)}",
            f"vllm:prefix_cache_hits_total{labels} {float(cache.hits)}",
            f"standin:requests_total {float(state['requests'])}",
            f"standin:pretokenized_total {float(state['pretokenized'])}",
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events-port", type=int, required=True)
    p.add_argument("--replay-port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--prefill-s-per-block", type=float, default=0.002)
    p.add_argument("--token-s", type=float, default=0.01)
    p.add_argument("--fail-status", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=0.0)
    p.add_argument("--retry-after", default="", help="Retry-After on --fail-status answers")
    args = p.parse_args()
    time.sleep(0)
    uvicorn.run(build(args), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
