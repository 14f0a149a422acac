#!/usr/bin/env bash
# Runs tests/test_failures.py ROUNDS times (default 20) with HOGS (default 2)
# CPU-burning processes beside it, and prints how many rounds passed: failure
# naming must hold when ranks are starved of CPU. Not part of CI (slow).
#   ROUNDS=5 HOGS=3 scripts/contention.sh -k "leaves or killed"
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ROUNDS=${ROUNDS:-20}
HOGS=${HOGS:-2}
hogs=()
for _ in $(seq "$HOGS"); do
    "$PY" -c "while True: pass" &
    hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
passed=0
for round in $(seq "$ROUNDS"); do
    log=$(mktemp)
    if timeout 1800 "$PY" -m pytest -q -p no:cacheprovider tests/test_failures.py "$@" >"$log" 2>&1; then
        passed=$((passed + 1))
        echo "round $round: passed ($(tail -n 1 "$log"))"
    else
        echo "round $round: FAILED"
        grep -E "^(FAILED|ERROR)|Error:" "$log" | head -n 20
    fi
    rm -f "$log"
done
echo "passed $passed of $ROUNDS rounds with $HOGS CPU hogs"
[ "$passed" -eq "$ROUNDS" ]
