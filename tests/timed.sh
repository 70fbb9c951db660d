#!/usr/bin/env bash
# `tests/timed.sh NAME ESTIMATE CMD...` (make test's steps): what runs and what it costs on the 2-core
# CPU CI runs on, before it runs; how long it took and its exit status after. A newcomer waiting
# on a silent step otherwise cannot tell a slow step from a stuck one.
set -u
name=$1 estimate=$2
shift 2
echo "== $name: about $estimate on a 2-core CPU: $*"
start=$(date +%s)
"$@"
status=$?
echo "== $name: took $(($(date +%s) - start)) s (exit status $status)"
exit $status
