"""The MCP server of the tests: the official Python SDK (`mcp`, pinned in
requirements.txt, installed by ./install) serving a few tools.

    server.py stdio                      over stdin/stdout (standalone tests)
    server.py http --port N [--json] [--legacy]
                                         Streamable HTTP on 127.0.0.1:N at /mcp
                                         (N 0: a free port, written to
                                         $MCP_PORT_FILE once it is bound)

Replies are text/event-stream (SSE) where the SDK streams them: under the
2026-07-28 revision once a tool sends a notification before its result
(slow_echo reports progress, so its reply is always an SSE stream), and always
under the session-based one. --json answers with application/json instead.
--legacy makes it a server of the previous, session-based revision only: a
request of the stateless revision (an MCP-Protocol-Version header that no
initialize handshake offers) is refused with 400, as servers before the
2026-07-28 revision refuse it, so the client must fall back to initialize and
Mcp-Session-Id.

Tasks (the `io.modelcontextprotocol/tasks` extension, SEP-2663, wire revision
2026-07-28) are served by the SDK's extension interface (`mcp.server.extension`,
which the SDK offers for exactly this): `long_job` answers a client that declares
the extension with a task handle and completes after `ms` milliseconds
(answering the handle itself `delay_ms` after making the task);
`confirm` makes a task that asks for input (an elicitation) and completes with
the answer given through `tasks/update`. `tasks/get`, `tasks/update` and
`tasks/cancel` are served; tasks live in this process (a client that restarts
polls them again). A client that does not declare the extension gets
`long_job`'s result at once, as the extension requires.

Every call is appended as one JSON line to $MCP_CALL_LOG when it is set, with
the protocol version it came under, the idempotency key in its `_meta` and the
X-Team / Authorization headers (stdio: none), so tests can see what ran, under which revision, with which
headers.

MCP_NOT_READY_MS=N makes the HTTP server answer 503 for its first N
milliseconds, as a server still starting does.
"""

import argparse
import asyncio
import json
import os
import socket
import sys

import time
import uuid
from typing import Any

from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import RequestParams
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

TASKS = "io.modelcontextprotocol/tasks"
POLL_MS = int(os.environ.get("MCP_TASK_POLL_MS", "1000"))


def log_line(entry: dict) -> None:
    path = os.environ.get("MCP_CALL_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class TaskParams(RequestParams):
    taskId: str
    inputResponses: dict[str, Any] | None = None


class Tasks(Extension):
    """The tasks extension: a task per long_job/confirm call, in memory."""

    identifier = TASKS

    def __init__(self) -> None:
        self.tasks: dict[str, dict] = {}

    def methods(self):
        return [
            MethodBinding("tasks/get", TaskParams, self.get),
            MethodBinding("tasks/update", TaskParams, self.update),
            MethodBinding("tasks/cancel", TaskParams, self.cancel),
        ]

    async def intercept_tool_call(self, params, ctx, call_next):
        name = params.name
        if name not in ("long_job", "confirm"):
            return await call_next(ctx)
        caps = ctx.session.client_capabilities
        declared = caps.extensions if caps and caps.extensions else {}
        args = params.arguments or {}
        meta = params.meta or {}
        key = meta.get("agents-exe.io/idempotencyKey") if isinstance(meta, dict) else None
        log_line({"tool": name, "args": args, "idempotencyKey": key, "tasks": TASKS in declared})
        if TASKS not in declared:
            return await call_next(ctx)
        task_id = str(uuid.uuid4())
        task = {
            "taskId": task_id,
            "status": "working",
            "createdAt": now_iso(),
            "lastUpdatedAt": now_iso(),
            "ttlMs": None,
            "pollIntervalMs": POLL_MS,
            "tool": name,
            "args": args,
            "done_at": time.monotonic() + int(args.get("ms", 0)) / 1000,
        }
        if name == "confirm":
            task["status"] = "input_required"
            task["inputRequests"] = {
                "q1": {
                    "method": "elicitation/create",
                    "params": {
                        "message": args.get("question", "Proceed?"),
                        "requestedSchema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
                    },
                }
            }
        self.tasks[task_id] = task
        # The task exists before its handle is answered: `delay_ms` widens
        # that window, as a slow server or network would (and says when the
        # task was made, so a test can act inside the window).
        delay_ms = int(args.get("delay_ms", 0))
        if delay_ms:
            log_line({"method": "task created", "taskId": task_id})
            await asyncio.sleep(delay_ms / 1000)
        return {"resultType": "task", **public(task)}

    def advance(self, task: dict) -> None:
        if task["status"] == "working" and time.monotonic() >= task["done_at"]:
            task["status"] = "completed"
            task["lastUpdatedAt"] = now_iso()
            if task["tool"] == "long_job":
                text = f"done: {task['args'].get('text', '')}"
            else:
                text = f"confirmed: {json.dumps(task.get('answers'), sort_keys=True)}"
            task["result"] = {"content": [{"type": "text", "text": text}], "isError": False}

    def find(self, params: TaskParams) -> dict:
        task = self.tasks.get(params.taskId)
        if task is None:
            raise ToolError(f"no task {params.taskId}")
        return task

    async def get(self, ctx, params: TaskParams):
        task = self.find(params)
        self.advance(task)
        log_line({"method": "tasks/get", "taskId": params.taskId, "status": task["status"]})
        return {"resultType": "complete", **public(task)}

    async def update(self, ctx, params: TaskParams):
        task = self.find(params)
        log_line({"method": "tasks/update", "taskId": params.taskId, "inputResponses": params.inputResponses})
        outstanding = task.get("inputRequests") or {}
        answers = {k: v for k, v in (params.inputResponses or {}).items() if k in outstanding}
        if task["status"] == "input_required" and answers:
            task["answers"] = answers
            task["status"] = "working"
            task.pop("inputRequests", None)
            task["done_at"] = time.monotonic()
        return {"resultType": "complete"}

    async def cancel(self, ctx, params: TaskParams):
        task = self.find(params)
        log_line({"method": "tasks/cancel", "taskId": params.taskId})
        if task["status"] in ("working", "input_required"):
            task["status"] = "cancelled"
            task["statusMessage"] = "cancelled by the client"
        return {"resultType": "complete"}


def public(task: dict) -> dict:
    keys = ("taskId", "status", "statusMessage", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs", "result", "inputRequests")
    return {k: task[k] for k in keys if k in task}


server = MCPServer("agents-test-mcp", extensions=[Tasks()])


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
async def long_job(text: str, ms: int, ctx: Context) -> str:
    """A long job: a task to poll for clients of the tasks extension, else waits `ms` and answers."""
    await asyncio.sleep(ms / 1000)
    return f"done: {text}"


@server.tool()
def confirm(question: str, ctx: Context) -> str:
    """Asks a person `question` (a task that asks for input)."""
    raise ToolError("confirm needs a client of the tasks extension")


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


def not_ready_for(ms: int, app):
    """Answer 503 for `ms` milliseconds after starting, as a server still
    starting up does (the test of the helper that waits for the server)."""
    ready_at = time.monotonic() + ms / 1000

    async def wrapped(scope, receive, send):
        if scope["type"] == "http" and time.monotonic() < ready_at:
            body = b"starting"
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())],
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
    not_ready_ms = int(os.environ.get("MCP_NOT_READY_MS", "0"))
    if not_ready_ms > 0:
        app = not_ready_for(not_ready_ms, app)
    # The socket is bound here, not by uvicorn, so that `--port 0` takes a
    # port no other process holds and says which: a port chosen by the test
    # and freed before this binds it can be taken by another test's server
    # in between, and that test would then talk to this one.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)
    port = sock.getsockname()[1]
    print(f"serving on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    port_file = os.environ.get("MCP_PORT_FILE")
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(port_file + ".tmp", port_file)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
