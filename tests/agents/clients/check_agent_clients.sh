#!/usr/bin/env bash
# Offline check that the real agent CLIs (Claude Code, Codex CLI, Gemini CLI) can register
# kvdb's stdio MCP server, connect to it and see its tools. Needs only node/npm and the npm
# registry: no API key, no login, nothing that calls a model.
# Usage: tests/agents/clients/check_agent_clients.sh   (KVDB=path/to/kvdb to override)
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
KVDB=${KVDB:-$ROOT/.venv/bin/kvdb}
# Pinned so a CLI release that changes its output does not silently turn this check red/green.
CLAUDE=@anthropic-ai/claude-code@2.1.197
CODEX=@openai/codex@0.171.0
GEMINI=@google/gemini-cli@0.61.0

WORK=$(mktemp -d /tmp/kvdb-agent-clients.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# A throwaway HOME: every CLI writes its config (and would write credentials) under it.
export HOME=$WORK/home PATH=$WORK/npm/node_modules/.bin:$PATH
mkdir -p "$HOME" && cd "$WORK" || exit 2
T="timeout 120"

echo "# installing $CLAUDE $CODEX $GEMINI"
$T npm install --silent --no-fund --no-audit --prefix "$WORK/npm" "$CLAUDE" "$CODEX" "$GEMINI" >/dev/null 2>&1 \
  || { echo "npm install failed"; exit 2; }

printf '{"role":"user","content":"Where is the harbour ledger?"}\n{"role":"assistant","content":"In the lamp room."}\n' > talk.jsonl
$T "$KVDB" --db "$WORK/a.duckdb" ingest talk.jsonl --keep tokens,search >ingest.log 2>&1 \
  || { tail -5 ingest.log; echo "ingest failed"; exit 2; }
SERVER=("$KVDB" --db "$WORK/a.duckdb" mcp)

fail=0
report() {  # agent, what, output, pattern
  if grep -q -- "$4" <<<"$3"; then echo "PASS $1: $2"; else echo "FAIL $1: $2"; echo "$3" | sed 's/^/    | /' | tail -5; fail=1; fi
}
tools() { grep -o -E "$1(search|show|sessions)\b" | sort -u | tr '\n' ' '; }

# Claude Code: `mcp list` spawns each server and does the MCP handshake.
$T claude mcp add kvdb -- "${SERVER[@]}" >/dev/null
out=$($T claude mcp list 2>&1); report claude "mcp list says Connected" "$out" 'kvdb:.*Connected'
# `-p` prints its init line (with the tools it loaded) before it finds out it is not logged in;
# by default -p does not wait for MCP servers, so make it wait.
out=$(echo hi | MCP_CONNECTION_NONBLOCKING=false $T claude -p --output-format stream-json --verbose 2>&1 | head -1)
report claude "tools seen: $(tools mcp__kvdb__ <<<"$out")" "$out" 'mcp__kvdb__search'

# Codex CLI: `mcp list` only reads config.toml; the app-server's mcpServerStatus/list is what
# actually connects and returns the tool list, and it answers without auth.
$T codex mcp add kvdb -- "${SERVER[@]}" >/dev/null 2>&1
out=$($T codex mcp list 2>&1); report codex "mcp list shows it enabled (config only, no connect)" "$out" 'kvdb .*enabled'
out=$($T python3 - <<'PY' 2>&1
import json, subprocess
p = subprocess.Popen(["codex", "app-server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, text=True)
def ask(i, method, params):
    p.stdin.write(json.dumps({"id": i, "method": method, "params": params}) + "\n"); p.stdin.flush()
    for line in p.stdout:
        m = json.loads(line)
        if m.get("id") == i: return m
ask(1, "initialize", {"clientInfo": {"name": "kvdb-check", "version": "0"}})
p.stdin.write('{"method": "initialized"}\n'); p.stdin.flush()
for s in ask(2, "mcpServerStatus/list", {})["result"]["data"]:
    print(s["name"], "tools:", *sorted(s.get("tools") or {}), "error:", s.get("toolsError"))
p.terminate()
PY
)
report codex "app-server mcpServerStatus/list: $out" "$out" '^kvdb tools:.*search'

# Gemini CLI: user scope keeps the config in HOME; it hides every MCP server in an untrusted
# folder, so trust the working folder first. `mcp list` then connects to each server.
$T gemini mcp add -s user kvdb "${SERVER[@]}" >/dev/null 2>&1
echo "{\"$WORK\": \"TRUST_FOLDER\"}" > "$HOME/.gemini/trustedFolders.json"
out=$($T gemini mcp list 2>&1); report gemini "mcp list says Connected (tools: not shown offline)" "$out" 'kvdb:.*Connected'

exit $fail
