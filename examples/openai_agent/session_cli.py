"""The command line the framework examples share: a session from ``--gateway`` (created, then finalized) or from
``--base-url``/``--api-key`` (env ``OPENAI_BASE_URL``/``OPENAI_API_KEY``), one episode, one JSON line out.
Standard library + ``httpx`` (which every OpenAI client brings) only: it runs in the frameworks' venv."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import httpx


def main(run_agent: Callable[..., Awaitable[dict[str, Any]]], doc: str, *, stream_help: str) -> None:
    """Parse the arguments, run ``run_agent(question, base_url=, api_key=, model=, max_tokens=, force_tool_call=,
    stream=)`` once and print its result (with ``--gateway``: and the finalized session's branch sizes)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default="What is 2+3?")
    parser.add_argument("--gateway", help="the gateway's URL: create a session, run, finalize it")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"), help="a session's base_url")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="a session's api_key")
    parser.add_argument("--model", default="agentrl", help="model name sent (the gateway serves one model)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--force-tool-call", action="store_true", help="constrain the first turns to an add call")
    parser.add_argument("--stream", action="store_true", help=stream_help)
    args = parser.parse_args()
    gateway = (args.gateway or "").rstrip("/")
    session = None
    if gateway:
        session = httpx.post(f"{gateway}/sessions", timeout=30).raise_for_status().json()
        args.base_url, args.api_key = session["base_url"], session["api_key"]
    if not args.base_url or not args.api_key:
        parser.error("give --gateway, or --base-url and --api-key (or OPENAI_BASE_URL and OPENAI_API_KEY)")
    out = asyncio.run(run_agent(args.question, base_url=args.base_url, api_key=args.api_key, model=args.model,
                                max_tokens=args.max_tokens, force_tool_call=args.force_tool_call, stream=args.stream))
    if session is not None:
        done = httpx.post(f"{gateway}/sessions/{session['id']}/finalize", timeout=30).raise_for_status().json()
        out["branches"] = [{"tokens": len(b["token_ids"]), "turns": len(b["turns"]), "parent": b["parent"]}
                           for b in done["branches"]]
    print(json.dumps(out))
