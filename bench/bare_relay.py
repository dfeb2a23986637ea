"""A bare aiohttp pass-through: no auth, no limits, nothing recorded; what Python can do.

    python -m bench.bare_relay PORT UPSTREAM_BASE_URL      (e.g. http://127.0.0.1:9100)
"""

import sys

import aiohttp
import uvloop
from aiohttp import web

UPSTREAM, SESSION = sys.argv[2].rstrip("/"), web.AppKey("session", aiohttp.ClientSession)


async def relay(request: web.Request) -> web.StreamResponse:
    body, session = await request.read(), request.app[SESSION]
    async with session.post(UPSTREAM + request.path, data=body, headers={"Content-Type": "application/json"}) as up:
        content_type = up.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": content_type})
        response = web.StreamResponse(status=up.status, headers={"Content-Type": content_type})
        await response.prepare(request)
        async for chunk in up.content.iter_any():
            await response.write(chunk)
        return response


async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
    yield
    await app[SESSION].close()


app = web.Application()
app.cleanup_ctx.append(session_ctx)
app.router.add_post("/v1/chat/completions", relay)
if __name__ == "__main__":
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, handler_cancellation=True,
                loop=uvloop.new_event_loop(), print=lambda *_: print("bare relay ready", flush=True))
