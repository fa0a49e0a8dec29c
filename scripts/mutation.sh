#!/usr/bin/env bash
# Mutation testing (mutmut) of the contract's core: fm_torch's map, fm_jax's pure ops, their
# debug checks and the host input checks. Not part of CI: it takes tens of minutes.
#
#   bash scripts/mutation.sh                 # every group, fm_torch first
#   bash scripts/mutation.sh torch jax-ops   # some groups (jax = every jax-* group of ALL below)
#   bash scripts/mutation.sh --rerun jax-ops # a finished run's survivors again, today's tests
#   bash scripts/mutation.sh --since REV jax-ops  # only the mutants on lines changed since REV
#   bash scripts/mutation.sh --resume jax-place   # a stopped run of a group, carried on
#
# One group per mutated module, each with the tests that exercise it (groups below). A group
# runs in a fresh snapshot of the working tree (tracked and untracked files, not ignored
# ones): the checkout is never touched and edits made meanwhile do not leak in. mutmut
# mutates only the lines the group's tests execute (accelerator-only code never runs on a
# CPU machine). An fm_jax mutant runs the group's whole test selection, stopping at its
# first failure (scripts/mutation_plugin.py: fm_jax's ops run traced inside jit, out of
# sight of mutmut's per-function test selection). Each mutant runs in a process forked
# from a server that has imported jax or torch but started nothing (a JAX backend does not
# survive a fork). mutmut first checks
# that a forced failure in every mutated function fails the tests (its "forced fail" run),
# so a snapshot that imports the unmutated code stops the run. The summary goes to
# docs/mutation.md and is printed: score, every mutant no test killed with its file:line,
# the mutation and, for the known equivalent ones (scripts/mutation_survivors.toml), why no
# test can kill it, and the lines no test of the group executes.
#
# --rerun: for a group whose run finished (its snapshot in MUTATION_DIR, the mutated file
# unchanged since), mutmut runs that run's survivors again in a copy of the snapshot given
# today's tests/ and today's other package files (GROUP-rerun), and the summary counts those
# the new tests kill.
#
# --since REV: each group in a fresh snapshot as above, but mutmut runs only the mutants on
# the lines of the mutated file that changed since git revision REV (its last full run's),
# and the summary counts those (REV is kept in the snapshot's `since` file, so one summary
# can hold full and incremental groups); the lines unchanged since keep REV's report. For a
# module whose full run takes longer than a session (jax-ops: hours on 2 cores).
#
# --resume: a group's full run that stopped (timed out, or killed to free the machine) goes
# on in its own snapshot, the mutated file unchanged since: mutmut lets every result it has
# stand and runs the mutants it has not, and the summary is made as for a finished run.
#
# Environment: MUTATION_JOBS (workers, default 2), MUTATION_TIMEOUT (seconds per group,
# default 3600), MUTATION_DIR (snapshots, default $TMPDIR/fm-jax-mutation), MUTATION_REPORT
# (summary path, default docs/mutation.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
JOBS=${MUTATION_JOBS:-2}
LIMIT=${MUTATION_TIMEOUT:-3600}
WORK=${MUTATION_DIR:-${TMPDIR:-/tmp}/fm-jax-mutation}
REPORT=${MUTATION_REPORT:-docs/mutation.md}
ALL=(torch jax-ops jax-rows jax-resolve jax-checks jax-inputs jax-host-checks jax-place
     jax-kernel jax-runtime jax-step jax-class)

if ! "$PY" -c "import mutmut, coverage" 2>/dev/null; then
    echo "mutmut is missing: .venv/bin/pip install -e '.[mutation]'" >&2
    exit 2
fi

# group -> the file it mutates, the tests that exercise it (globs; missing files are
# skipped) and the modules its fork server imports first.
file_of() {
    case $1 in
        torch) echo fm_torch/future_map.py ;;
        jax-ops) echo fm_jax/ops/ops.py ;;
        jax-rows) echo fm_jax/ops/rows.py ;;
        jax-resolve) echo fm_jax/ops/resolve.py ;;
        jax-checks) echo fm_jax/ops/checks.py ;;
        jax-inputs) echo fm_jax/host/host_inputs.py ;;
        jax-host-checks) echo fm_jax/host/validate.py ;;
        jax-place) echo fm_jax/host/place.py ;;
        jax-kernel) echo fm_jax/ops/rows.py ;;
        jax-runtime) echo fm_jax/map/runtime.py ;;
        jax-step) echo fm_jax/map/engine_step.py ;;
        jax-class) echo fm_jax/map/future_map.py ;;
        *) echo "unknown group '$1' (${ALL[*]}, jax)" >&2; return 1 ;;
    esac
}
tests_of() {  # the table's mesh and sharded cases run in a subprocess mutmut cannot reach
    local table=tests/test_bad_input_table.py
    case $1 in
        torch) echo "tests/test_fm_torch_*.py tests/test_spec_mixed.py
                     $table::test_fm_torch_refuses_and_keeps_every_byte" ;;
        jax-ops|jax-rows|jax-resolve) echo "tests/test_fm_jax_rows.py
                       tests/test_fm_jax_relay_fields.py tests/test_fm_jax_ops.py tests/test_fm_jax_debug.py
                       tests/test_fm_jax_gather.py $table::test_pure_ops_refuse_what_tracing_sees
                       tests/test_fm_jax_mutants.py tests/test_spec_mixed.py
                       tests/test_reliability.py::test_sharded_stash_names_each_payload_row_that_is_no_array" ;;
        jax-checks) local g=tests/test_fm_jax_gather.py m=tests/test_spec_mixed.py
                    echo "tests/test_fm_jax_debug.py tests/test_fm_jax_debug_channel.py
                          tests/test_fm_jax_mutants.py
                          $g::test_debug_reports_a_second_read_and_poisons_exactly_the_slots_read
                          $g::test_debug_reports_a_spec_length_never_published
                          $g::test_a_traced_mixed_batch_without_token_slots_is_reported
                          $g::test_token_slots_of_a_batch_that_is_not_mixed
                          $g::test_debug_reports_negative_device_ids
                          $m::test_the_pure_ops_report_running_rows_out_of_order_in_debug
                          $m::test_a_running_row_never_published_is_reported_by_both_twins
                          $m::test_a_slot_the_running_rows_and_the_draft_both_read_is_read_twice
                          $m::test_the_sentinel_protocol_reports_a_traced_spec_mixed_batch_in_debug
                          $m::test_the_running_row_check_holds_at_edge_sizes_and_slot_one" ;;
        # Host inputs and their value checks: the class's and the engine step's refusals,
        # the twins' shared judgements (int casts, declared dtypes, one id per row).
        jax-inputs|jax-host-checks|jax-place) local r=tests/test_reliability.py
                     local e=tests/test_fm_jax_engine_step.py
                     echo "tests/test_fm_jax_validate.py tests/test_fm_jax_inputs.py tests/test_fm_jax_decisions.py
                           tests/test_fm_jax_declarations.py tests/test_fm_jax_place.py
                           tests/test_fm_jax_steady_calls.py
                           tests/test_fm_jax_mutants.py tests/test_fm_jax_gather.py
                           $table::test_fm_jax_class_refuses_and_keeps_every_byte
                           $r::test_host_negative_tokens_and_lengths_are_refused_by_both_twins
                           $r::test_both_twins_judge_int64_rows_for_an_int32_field_alike
                           $r::test_a_scalar_step_input_is_named_a_scalar
                           $r::test_a_per_token_step_input_counts_tokens_not_indices
                           $r::test_a_python_list_step_input_is_cast_where_its_values_fit
                           $r::test_a_float_field_given_another_dtype_names_both_dtypes
                           $r::test_complex_host_rows_are_packed_like_every_other_dtype
                           tests/test_fm_jax_relay_fields.py tests/test_spec_mixed.py
                           $e::test_bad_input_is_refused_before_anything_runs_or_is_donated
                           $e::test_each_step_of_a_map_checks_its_own_declared_inputs
                           $e::test_step_leaves_the_bytes_of_resolve_then_finish
                           $e::test_sentinel_step_returns_the_invalidated_batch_and_gather_the_batch_as_given
                           $e::test_a_host_fed_step_is_one_executable_taking_one_host_buffer" ;;
        jax-kernel) echo "tests/test_fm_jax_rows.py" ;;
        # The map's runtime (state, lock, StateLost and reset, a failed call diagnosed),
        # the class's serialized ops and buffers, the engine step: the tests of each that
        # fail, refuse or donate first (a mutant stops at its first failing test).
        jax-runtime) local r=tests/test_reliability.py
                     echo "$r::test_a_forward_failing_while_the_step_runs_loses_the_map_by_name_until_reset
                           $r::test_a_class_op_failing_while_it_runs_loses_the_map_by_name
                           $r::test_donation_misuse_is_refused_by_name_and_the_map_keeps_serving
                           $r::test_a_step_refused_before_it_ran_leaves_the_map_whole
                           $r::test_a_forward_failing_while_traced_leaves_the_step_count_as_it_was
                           $r::test_a_step_output_that_is_no_array_of_rows_is_named
                           $r::test_device_lengths_donated_by_the_caller_after_publish_are_read_from_the_buffer
                           $r::test_a_monitor_thread_reads_buffer_copies_while_others_serve
                           tests/test_fm_jax_host_reads.py
                           tests/test_fm_jax_engine_step.py::test_debug_violation_in_a_step_is_reported_at_check_with_step_and_op
                           tests/test_fm_jax_debug.py::test_debug_invalidate_checks_device_slots" ;;
        jax-class) local r=tests/test_reliability.py
                   echo "$r::test_a_forward_failing_while_the_step_runs_loses_the_map_by_name_until_reset
                         $r::test_a_class_op_failing_while_it_runs_loses_the_map_by_name
                         $r::test_donation_misuse_is_refused_by_name_and_the_map_keeps_serving
                         $r::test_a_step_refused_before_it_ran_leaves_the_map_whole
                         $r::test_a_monitor_thread_reads_buffer_copies_while_others_serve
                         $r::test_device_lengths_donated_by_the_caller_after_publish_are_read_from_the_buffer
                         tests/test_fm_jax_host_reads.py
                         tests/test_fm_jax_debug.py::test_debug_invalidate_checks_device_slots" ;;
        jax-step) local r=tests/test_reliability.py e=tests/test_fm_jax_engine_step.py
                  # not $e's mesh test: it runs in a subprocess mutmut cannot reach
                  echo "$e::test_step_leaves_the_bytes_of_resolve_then_finish
                        $e::test_sentinel_step_returns_the_invalidated_batch_and_gather_the_batch_as_given
                        $e::test_bad_input_is_refused_before_anything_runs_or_is_donated
                        $e::test_step_donates_the_map_state_and_the_named_args
                        $e::test_a_forward_that_returns_no_step_output_is_named
                        $e::test_step_declarations_are_checked_when_made
                        $e::test_warm_up_covers_every_bucket_and_the_guard_refuses_the_rest
                        $e::test_a_host_fed_step_is_one_executable_taking_one_host_buffer
                        $r::test_a_guarded_step_serves_what_serving_passes
                        $r::test_a_warmed_step_hands_its_forward_each_host_mode
                        $r::test_a_forward_failing_while_the_step_runs_loses_the_map_by_name_until_reset
                        $r::test_donation_misuse_is_refused_by_name_and_the_map_keeps_serving
                        $r::test_a_step_refused_before_it_ran_leaves_the_map_whole
                        $r::test_a_step_output_that_is_no_array_of_rows_is_named
                        $r::test_a_scalar_step_input_is_named_a_scalar
                        $r::test_a_per_token_step_input_counts_tokens_not_indices
                        $r::test_a_python_list_step_input_is_cast_where_its_values_fit
                        $e::test_spec_step_relays_the_draft_like_finish" ;;
    esac
}
preload_of() {
    case $1 in
        torch) echo "numpy pytest hypothesis torch" ;;
        *) echo "numpy pytest hypothesis jax jax.numpy jax.experimental.checkify chex" ;;
    esac
}
# JAX's persistent compilation cache, shared by a group's mutants: an unmutated op compiles
# once, a mutated one (other HLO) misses it. So no group runs a test that needs a backend
# compile to happen (tests/test_fm_jax_class.py, test_fm_jax_warm_up.py): a cache hit skips
# it. A test that counts none after warm-up may run (jax-step): a cache hit is no compile
# either, and what kills a mutant that warms too little is the serving guard's refusal.
jax_cache_of() {
    case $1 in
        jax-*) echo "$WORK/$1/jax-cache" ;;
    esac
}
# The module whose mutants run the group's whole selection (scripts/mutation_plugin.py):
# fm_jax's. fm_torch's tests call the map's methods, which mutmut's own per-function test
# selection sees, so its mutants run only the tests that call them (much faster).
whole_selection_of() {
    case $1 in
        jax-*) local file
            file=$(file_of "$1")
            file=${file%.py}
            echo "${file//\//.}" ;;
    esac
}
existing_tests() {  # existing_tests GROUP: the group's tests whose files exist
    local t
    # shellcheck disable=SC2086  # the globs expand here, in the root
    for t in $(tests_of "$1"); do if [ -e "${t%%::*}" ]; then echo "$t"; fi; done
}
selection() {  # selection GROUP: mutmut's config line selecting the group's tests
    # shellcheck disable=SC2046  # one word per test
    echo "pytest_add_cli_args_test_selection = $(toml_list $(existing_tests "$1"))"
}
# python -c RESELECT PYPROJECT LINE: LINE replaces the test-selection line of a snapshot's config.
RESELECT='import re, sys
path, line = sys.argv[1:]
text = open(path).read()
key = "pytest_add_cli_args_test_selection = "
open(path, "w").write(re.sub("^" + re.escape(key) + ".*$", lambda _: line, text, count=1, flags=re.M))'
toml_list() {  # words -> a TOML list of strings
    local out="" w
    for w in "$@"; do out+="${out:+, }\"$w\""; done
    echo "[$out]"
}

# Everything below is functions, and main's call is the file's last line: bash has read it
# all before main runs, so editing this file during a run (which takes a while) cannot
# change what the run does.

# The env a group's mutmut runs in: its whole-selection module and its JAX compile cache.
mutmut_in() {  # mutmut_in DIR GROUP MUTMUT_ARGS...
    local dir=$1 g=$2 cache module
    shift 2
    cache=$(jax_cache_of "$g")
    module=$(whole_selection_of "$g")
    (cd "$dir" && export FM_MUTATION_MODULE=$module ${cache:+JAX_COMPILATION_CACHE_DIR=$cache} \
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
        && timeout "$LIMIT" "$PY" -m mutmut "$@" >mutmut.log 2>&1) || {
        echo "mutmut failed or timed out (log: $dir/mutmut.log):" >&2
        tail -c 2000 "$dir/mutmut.log" | tr '\r' '\n' | tail -20 >&2
    }
}

write_report() {  # write_report [--rerun DIR]... DIR...: the summary to $REPORT, printed
    mkdir -p "$(dirname "$REPORT")"
    "$PY" scripts/mutation_report.py --survivors scripts/mutation_survivors.toml \
        --output "$REPORT" "$@"
    cat "$REPORT"
}

rerun() {  # rerun GROUP...: each finished run's survivors, with today's tests
    local g base dir file names reruns=() bases=()
    for g in "$@"; do
        file=$(file_of "$g")
        base=$WORK/$g
        dir=$WORK/$g-rerun
        if [ ! -d "$base/mutants" ] || ! cmp -s "$file" "$base/$file"; then
            echo "$g: no finished run of today's $file in $base: run the group first" >&2
            return 1
        fi
        names=$(cd "$base" && "$PY" -m mutmut results 2>/dev/null | sed -n 's/^ *\([^ ]*\): survived$/\1/p')
        rm -rf "$dir"
        cp -a "$base" "$dir"
        cp -a tests/. "$dir/tests/"
        cp -a tests/. "$dir/mutants/tests/"
        # Today's code beside today's tests: every package file but the mutated one (the
        # same as the run's), in the snapshot and in mutmut's copy of it.
        git ls-files -z --cached --others --exclude-standard -- fm_jax fm_torch fm_parity fm_bench fm_serve |
            while IFS= read -r -d '' f; do
                [ "$f" = "$file" ] && continue
                for d in "$dir" "$dir/mutants"; do
                    mkdir -p "$d/$(dirname "$f")" && cp "$f" "$d/$f"
                done
            done
        # Today's test selection for the group too (the snapshot's is the run's).
        "$PY" -c "$RESELECT" "$dir/pyproject.toml" "$(selection "$g")"
        echo "== $g: mutmut on the $(echo "$names" | wc -w) survivors of $base, today's tests"
        # shellcheck disable=SC2086  # one argument per mutant name
        [ -z "$names" ] || mutmut_in "$dir" "$g" run --max-children "$JOBS" $names
        bases+=("$base")
        reruns+=(--rerun "$dir")
    done
    write_report "${reruns[@]}" "${bases[@]}"
}

finish_group() {  # finish_group DIR GROUP START SECONDS_BEFORE: coverage, the run's time
    local dir=$1 g=$2 start=$3 before=$4 file tests
    file=$(file_of "$g")
    tests=$(existing_tests "$g")
    # The lines no test of the group executes (never mutated), for the summary.
    # shellcheck disable=SC2086
    (cd "$dir" && "$PY" -m coverage run --data-file=.coverage.group --include="$file" \
        -m pytest -q -p no:cacheprovider --hypothesis-seed=0 $tests >coverage.log 2>&1 \
        && "$PY" -m coverage json --data-file=.coverage.group -o coverage.json -q) \
        || echo "coverage of $g failed (log: $dir/coverage.log)" >&2
    echo "$((before + $(date +%s) - start))" >"$dir/seconds"
    echo "   $(cat "$dir/seconds")s"
}

resume() {  # resume GROUP...: each stopped full run carried on in its snapshot
    local g dir file start dirs=()
    for g in "$@"; do
        file=$(file_of "$g")
        dir=$WORK/$g
        if [ ! -d "$dir/mutants" ] || [ -e "$dir/since" ] || ! cmp -s "$file" "$dir/$file"; then
            echo "$g: no stopped full run of today's $file in $dir: run the group" >&2
            return 1
        fi
        echo "== $g: mutmut on $file carried on ($JOBS workers, at most ${LIMIT}s)"
        start=$(date +%s)
        mutmut_in "$dir" "$g" run --max-children "$JOBS"
        finish_group "$dir" "$g" "$start" "$(cat "$dir/seconds" 2>/dev/null || echo 0)"
        dirs+=("$dir")
    done
    write_report "${dirs[@]}"
}

main() {
    case ${1:-} in
        --rerun) shift; rerun "$@"; return ;;
        --resume) shift; resume "$@"; return ;;
    esac
    local since=""
    if [ "${1:-}" = --since ]; then
        since=${2:?--since takes a git revision}
        git rev-parse --verify -q "$since^{commit}" >/dev/null || {
            echo "--since: '$since' is not a commit" >&2
            return 2
        }
        shift 2
    fi
    [ $# -gt 0 ] || set -- "${ALL[@]}"
    groups=()
    for g in "$@"; do
        if [ "$g" != jax ]; then groups+=("$g"); continue; fi
        for a in "${ALL[@]}"; do if [[ $a == jax-* ]]; then groups+=("$a"); fi; done
    done
    dirs=()
    for g in "${groups[@]}"; do
        file=$(file_of "$g")
        dir=$WORK/$g
        rm -rf "$dir"
        mkdir -p "$dir"
        git ls-files -z --cached --others --exclude-standard \
            | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$dir"
        preload_of "$g" | tr ' ' '\n' >"$dir/preload.txt"
        cp scripts/mutation_plugin.py "$dir/"
        # shellcheck disable=SC2086
        cat >>"$dir/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["fm_jax", "fm_torch", "fm_parity", "fm_bench", "fm_serve"]
only_mutate = ["$file"]
mutate_only_covered_lines = true
$(selection "$g")
also_copy = ["mutation_plugin.py"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "mutation_plugin", "--hypothesis-seed=0"]
process_isolation = "forkserver"
forkserver_warmup = "import"
preload_modules_file = "preload.txt"
use_setproctitle = false
EOF
        echo "== $g: mutmut on $file ($JOBS workers, at most ${LIMIT}s)${since:+, lines changed since $since}"
        start=$(date +%s)
        if [ -n "$since" ]; then
            git rev-parse "$since" >"$dir/since"  # the summary counts this run incrementally
            # mutmut generates every mutant (and collects its test stats) before it filters
            # by name: a name matching none stops it right there, with the mutants on disk.
            mutmut_in "$dir" "$g" run --max-children "$JOBS" fm-jax-generate-only 2>/dev/null
            names=$("$PY" scripts/mutation_report.py --survivors scripts/mutation_survivors.toml \
                --list-changed "$dir")
            echo "   $(echo "$names" | wc -w) mutants on lines changed since $since"
            # shellcheck disable=SC2086  # one argument per mutant name
            [ -z "$names" ] || mutmut_in "$dir" "$g" run --max-children "$JOBS" $names
        else
            mutmut_in "$dir" "$g" run --max-children "$JOBS"
        fi
        finish_group "$dir" "$g" "$start" 0
        dirs+=("$dir")
    done

    write_report "${dirs[@]}"
}

main "$@"; exit  # one line: bash has read it whole before main runs
