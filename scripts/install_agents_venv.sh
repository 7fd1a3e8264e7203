#!/usr/bin/env bash
# Creates (or brings up to date) the agent frameworks' own venv, .venv-agents by default: openai-agents, langgraph,
# langchain-openai (requirements/agents.txt) for examples/openai_agent/ and tests/gateway/test_frameworks.py.
# Its own venv because openai-agents needs openai>=3 and SGLang's venv pins openai==2.8.0 (and a framework runs in
# its own process, talking HTTP to the gateway, as users run them). ~20 s and ~185 MB the first time, no torch; a
# no-op while the stamp holds the requirements file's hash.
set -euo pipefail
VENV=${1:-.venv-agents}
PYTHON=${PYTHON:-python3}
REQS="$(cd "$(dirname "$0")/.." && pwd)/requirements/agents.txt"
STAMP="$VENV/.agentrl-agents"
WANT=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip --disable-pip-version-check -q install -r "$REQS" 2>&1 \
  | { grep -v "^WARNING: Location 'file:" || true; }
"$VENV/bin/python" -c "import agents, langgraph, langchain_openai"
echo "$WANT" > "$STAMP"
echo "agentrl: agents venv ready ($VENV)"
