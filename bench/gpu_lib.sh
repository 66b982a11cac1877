# The machinery of bench/gpu.sh, sourced by it (and by tests/test_gpu_run.py): steps with their
# limits, the budget check, the background job. It runs nothing when sourced.
#
# A step is one line of the plan:  plan NAME LIMIT_S 'COMMAND'
#   COMMAND runs under `bash -c` (the functions gpu.sh exports are there), killed at LIMIT_S seconds
#   (SIGTERM, SIGKILL KILL_AFTER s later). It sees STEP_LIMIT (its seconds, to size its own work
#   from) and STEP_OUT ($RES/NAME/, created): what it writes there as it goes stays when it is cut
#   off. A function collect_NAME, if defined, runs after the step whatever its end (outside the
#   limit: copies only). Output: $RES/NAME.log; one row in $RES/steps.tsv per step, written at once.
# CPU work beside the GPU steps:  plan NAME LIMIT_S 'COMMAND' background  starts it there and goes
#   on; a later  plan NAME await  waits for its end (by its limit at the latest) and records its row.
# plan_seconds: the worst case of the whole plan, every step at its limit, so a plan is checked
#   against its time slot before anything starts.
# Needs: RES (results directory) and WORK (scratch), exported; T0 (start, epoch seconds); KILL_AFTER
# optional.

KILL_AFTER=${KILL_AFTER:-3}
PLAN_NAMES=()
PLAN_LIMITS=()
PLAN_CMDS=()

PLAN_MODES=()

plan() {  # NAME LIMIT_S COMMAND [background]  |  NAME await
    PLAN_NAMES+=("$1")
    if [[ "$2" == await ]]; then
        PLAN_LIMITS+=(0) PLAN_CMDS+=("") PLAN_MODES+=(await)
    else
        PLAN_LIMITS+=("$2") PLAN_CMDS+=("$3") PLAN_MODES+=("${4:-step}")
    fi
}

plan_seconds() {  # seconds from the start to the plan's end, every step at its limit (+ KILL_AFTER)
    local t=0 i
    declare -A ends=()
    for i in "${!PLAN_NAMES[@]}"; do
        case "${PLAN_MODES[$i]}" in
            step) t=$((t + PLAN_LIMITS[i] + KILL_AFTER)) ;;
            background) ends[${PLAN_NAMES[$i]}]=$((t + PLAN_LIMITS[i] + KILL_AFTER)) ;;
            await) t=$((t > ends[${PLAN_NAMES[$i]}] ? t : ends[${PLAN_NAMES[$i]}])) ;;
        esac
    done
    echo "$t"
}

record() {  # NAME RC SECONDS LIMIT: one row of steps.tsv
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RES/steps.tsv"
}

step() {  # NAME LIMIT_S COMMAND
    local name=$1 limit=$2 cmd=$3 start rc
    mkdir -p "$RES/$name"
    start=$(date +%s)
    echo "=== [$name] $(date -u +%H:%M:%S) +$((start - T0))s (limit ${limit}s): $cmd" | tee -a "$RES/$name.log"
    STEP_LIMIT=$limit STEP_OUT="$RES/$name" timeout --kill-after="$KILL_AFTER" "$limit" bash -c "$cmd" \
        >>"$RES/$name.log" 2>&1 </dev/null
    rc=$?
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then echo "=== [$name] TIMED OUT after ${limit}s" | tee -a "$RES/$name.log"; fi
    if declare -F "collect_$name" >/dev/null; then "collect_$name" >>"$RES/$name.log" 2>&1 || true; fi
    echo "=== [$name] rc=$rc in $(($(date +%s) - start))s" | tee -a "$RES/$name.log"
    grep -v '^=== \[' "$RES/$name.log" | tail -n 3
    record "$name" "$rc" "$(($(date +%s) - start))" "$limit"
}

run_plan() {  # every planned step, in the order planned
    local i
    for i in "${!PLAN_NAMES[@]}"; do
        "${PLAN_MODES[$i]}" "${PLAN_NAMES[$i]}" "${PLAN_LIMITS[$i]}" "${PLAN_CMDS[$i]}"
    done
}

# --- the background job: CPU work that runs while the GPU steps do --------------------------------
background() {  # NAME LIMIT_S COMMAND: started now, killed at LIMIT_S; `await NAME` waits for its end
    local name=$1 limit=$2 cmd=$3
    mkdir -p "$RES/$name"
    (
        start=$(date +%s)
        STEP_LIMIT=$limit STEP_OUT="$RES/$name" timeout --kill-after="$KILL_AFTER" "$limit" bash -c "$cmd" \
            >>"$RES/$name.log" 2>&1 </dev/null
        rc=$?
        echo "$rc $(($(date +%s) - start))" >"$WORK/$name.done.tmp" && mv "$WORK/$name.done.tmp" "$WORK/$name.done"
    ) &
    echo "$limit" >"$WORK/$name.limit"
    echo "=== [$name] started in the background (limit ${limit}s): $cmd" | tee -a "$RES/$name.log"
}

await() {  # NAME [ignored...]: wait for the background job (it ends by its own limit), record it as a step
    local name=$1 limit rc secs
    limit=$(cat "$WORK/$name.limit" 2>/dev/null) || { echo "=== [$name] was never started" >&2; return 1; }
    while [[ ! -f "$WORK/$name.done" ]]; do sleep 1; done
    read -r rc secs <"$WORK/$name.done"
    echo "=== [$name] rc=$rc in ${secs}s (background, waited until +$(($(date +%s) - T0))s)" | tee -a "$RES/$name.log"
    record "$name" "$rc" "$secs" "$limit"
    return "$rc"
}
