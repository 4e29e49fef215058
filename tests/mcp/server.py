"""The MCP server of the tests: the official Python SDK (`mcp`, pinned in
requirements.txt, installed by ./install) serving a few tools.

    server.py stdio                      over stdin/stdout (standalone tests)
    server.py http --port N [--json] [--legacy]
                                         Streamable HTTP on 127.0.0.1:N at /mcp

Replies are text/event-stream (SSE) where the SDK streams them: under the
2026-07-28 revision once a tool sends a notification before its result
(slow_echo reports progress, so its reply is always an SSE stream), and always
under the session-based one. --json answers with application/json instead.
--legacy makes it a server of the previous, session-based revision only: a
request of the stateless revision (an MCP-Protocol-Version header that no
initialize handshake offers) is refused with 400, as servers before the
2026-07-28 revision refuse it, so the client must fall back to initialize and
Mcp-Session-Id.

Every call is appended as one JSON line to $MCP_CALL_LOG when it is set, with
the protocol version it came under, the idempotency key in its `_meta` and the
X-Team / Authorization headers (stdio: none), so tests can see what ran, under which revision, with which
headers.
"""

import argparse
import asyncio
import json
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

server = MCPServer("agents-test-mcp")


def record(ctx: Context, tool: str, args: dict) -> None:
    path = os.environ.get("MCP_CALL_LOG")
    if not path:
        return
    headers = ctx.headers or {}
    meta = ctx.request_context.meta
    if meta is not None and hasattr(meta, "model_dump"):
        meta = meta.model_dump(by_alias=True)
    entry = {
        "idempotencyKey": (meta or {}).get("agents-exe.io/idempotencyKey"),
        "tool": tool,
        "args": args,
        "protocolVersion": ctx.protocol_version,
        "xTeam": headers.get("x-team"),
        "authorization": headers.get("authorization"),
    }
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


@server.tool()
def add(a: int, b: int, ctx: Context) -> int:
    """Adds two integers."""
    record(ctx, "add", {"a": a, "b": b})
    return a + b


@server.tool()
def greet(name: str, ctx: Context) -> str:
    """Greets someone by name."""
    record(ctx, "greet", {"name": name})
    return f"Hello, {name}!"


@server.tool()
async def slow_echo(text: str, ms: int, ctx: Context) -> str:
    """Waits `ms` milliseconds, then answers `text`."""
    record(ctx, "slow_echo", {"text": text, "ms": ms})
    # Progress before the result: the reply becomes an SSE stream.
    await ctx.report_progress(0.5, 1.0, "halfway")
    await asyncio.sleep(ms / 1000)
    return text


@server.tool()
def refuse(reason: str, ctx: Context) -> str:
    """Always fails with `reason` (an isError result)."""
    record(ctx, "refuse", {"reason": reason})
    raise ToolError(f"refused: {reason}")


@server.tool()
def hidden(ctx: Context) -> str:
    """A tool agents filter out with `tools:`."""
    record(ctx, "hidden", {})
    return "you should not see this"


def legacy_only(app):
    """Refuse requests of the stateless revision, as a pre-2026 server does."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            version = headers.get("mcp-protocol-version")
            if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
                body = json.dumps(
                    {
                        "jsonrpc": "2.0",
                        "id": "server-error",
                        "error": {"code": -32600, "message": f"Bad Request: Unsupported protocol version: {version}"},
                    }
                ).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 400,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--legacy", action="store_true")
    args = parser.parse_args()
    if args.transport == "stdio":
        server.run("stdio")
        return
    import uvicorn

    app = server.streamable_http_app(json_response=args.json, host="127.0.0.1")
    if args.legacy:
        app = legacy_only(app)
    print(f"serving on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
