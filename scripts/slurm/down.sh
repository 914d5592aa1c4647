#!/usr/bin/env bash
# Stop exactly the SLURM/munge daemons that scripts/slurm/up.sh started (PIDs from its
# state file), and remove the slurm.conf up.sh wrote (its mark on the first line): a conf
# naming a stopped controller makes every `scontrol` wait ~9 s, and Snakemake's SLURM executor
# plugin runs `scontrol show config` whenever snakemake starts, even under a local profile.
# Nothing else is touched. Idempotent: with nothing recorded it does nothing.
set -uo pipefail
STATE_DIR=${ZNNI_SLURM_STATE:-/var/lib/znni-slurm}
PIDS=$STATE_DIR/pids
log() { printf '[slurm-down %s] %s\n' "$(date +%T)" "$*" >&2; }

alive() {
    local st
    st=$(ps -o stat= -p "$1" 2>/dev/null | tr -d ' ') || return 1
    [ -n "$st" ] && [ "${st:0:1}" != Z ]   # PID 1 reaps late: a zombie is dead
}

CONF=/etc/slurm/slurm.conf
MARK="# written by znni scripts/slurm/up.sh"
drop_conf() { if [ -f "$CONF" ] && head -n1 "$CONF" | grep -qF "$MARK"; then rm -f "$CONF"; log "removed $CONF (written by up.sh)"; fi; }

[ -s "$PIDS" ] || { log "nothing recorded in $PIDS"; rm -f "$PIDS"; drop_conf; exit 0; }

# Stop in reverse start order (slurmd, slurmctld, munged).
mapfile -t entries < <(tac "$PIDS")
for e in "${entries[@]}"; do
    name=${e% *}; pid=${e#* }
    if alive "$pid" && grep -q "$name" "/proc/$pid/comm" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then log "$name ($pid) ignored SIGTERM: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
        log "stopped $name ($pid)"
    fi
done
# Stale pid files break later `apt-get remove` and confuse the next start.
rm -f "$PIDS" "$STATE_DIR/slurmctld.pid" "$STATE_DIR/slurmd.pid" /run/munge/munged.pid
drop_conf
