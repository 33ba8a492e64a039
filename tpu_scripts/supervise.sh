#!/usr/bin/env bash
# Runs on a worker (launch.sh starts it there): `jaxrl4llm train ARGS... --resume auto`, run again
# after a preemption (exit status 75: the step was saved) or a crash (a peer host died: the
# heartbeat stops every process), at most JAXRL4LLM_MAX_RESTARTS times, each relaunch logged.
# Stops for good on 0 (finished), 2 (a bad config or an unreadable checkpoint: the error names
# the fix) and 130/143 (stopped by hand). `--resume auto` resumes from the latest complete
# checkpoint, or starts fresh when there is none, so the first launch and every relaunch are
# the same command; each relaunch loads its programs from the compile cache
# (trainer.compile_cache, on the worker's disk) instead of compiling them again.
set -uo pipefail

max=${JAXRL4LLM_MAX_RESTARTS:-5}      # relaunches before giving up
delay=${JAXRL4LLM_RESTART_DELAY:-30}  # seconds between a stop and the relaunch (peers stop too, then all rejoin)
train=${JAXRL4LLM_TRAIN:-.venv/bin/jaxrl4llm}

say() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) supervise.sh [$(hostname)]: $*"; }

# One run a worker: the lock is held while this script or a train it started lives (fd 9 is
# inherited), so launch.sh run again starts only the workers that lost theirs.
exec 9>> "$HOME/.jaxrl4llm-supervise.lock"
if ! flock -n 9; then
  say "a run is already supervised on this worker: not starting another"
  exit 0
fi

relaunches=0
while true; do
  "$train" train "$@" --resume auto
  status=$?
  case $status in
    0) say "the run finished"; exit 0 ;;
    2) say "exit status 2 (a bad config or an unreadable checkpoint; see the error above): not relaunching"; exit 2 ;;
    130 | 143) say "exit status $status (stopped by hand: Ctrl-C or SIGTERM twice): not relaunching"; exit "$status" ;;
    75) why="preempted (SIGTERM): its step was saved" ;;
    *) why="crashed (a peer host lost, out of memory, ...)" ;;
  esac
  if ((relaunches >= max)); then
    say "exit status $status, $why; giving up after $max relaunches (JAXRL4LLM_MAX_RESTARTS)"
    exit "$status"
  fi
  relaunches=$((relaunches + 1))
  say "exit status $status, $why; relaunch $relaunches of $max in ${delay}s with --resume auto"
  sleep "$delay"
done
