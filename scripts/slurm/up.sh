#!/usr/bin/env bash
# Bring up a single-node SLURM cluster on localhost (Debian/Ubuntu, run as root).
#
#   scripts/slurm/up.sh          # install if needed, configure, start munged/slurmctld/slurmd
#   scripts/slurm/down.sh        # stop exactly the daemons this script started
#
# Design (facts behind each choice: docs/slurm.md):
# - No slurmdbd/MariaDB: job states come from `squeue` (MinJobAge=300 keeps finished jobs
#   visible for 5 min); the slurm profile sets `slurm-status-command: squeue`. Finished jobs are
#   recorded by jobcomp/filetxt (one line per end of a job, with its state, time limit and TRES),
#   which `sacct --completion` reads: the tests check what each attempt really ran with.
# - No systemd: the daemons are started here, their PIDs recorded in $STATE_DIR/pids;
#   down.sh stops exactly those PIDs and nothing else.
# - Idempotent: when the recorded daemons are alive and the node answers, it exits at once.
# - Memory is enforced without cgroups by jobacct_gather/linux + OverMemoryKill (a job over
#   its --mem ends OUT_OF_MEMORY), and time limits by slurmctld (TIMEOUT): the retry tests
#   of tests/test_slurm_faults.py rely on both.
set -euo pipefail

STATE_DIR=${ZNNI_SLURM_STATE:-/var/lib/znni-slurm}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by znni scripts/slurm/up.sh"
HOST=$(hostname -s)
log() { printf '[slurm-up %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"

alive() {  # pid -> 0 if running and not a zombie (PID 1 here reaps late)
    local st
    st=$(ps -o stat= -p "$1" 2>/dev/null | tr -d ' ') || return 1
    [ -n "$st" ] && [ "${st:0:1}" != Z ]
}

all_alive() {
    [ -f "$STATE_DIR/pids" ] || return 1
    local name pid
    while read -r name pid; do alive "$pid" || return 1; done <"$STATE_DIR/pids"
    grep -q slurmd "$STATE_DIR/pids"
}

node_ready() {
    local s
    s=$(sinfo -h -N -n "$HOST" -o %t 2>/dev/null | head -n1) || return 1
    [[ "$s" == idle* || "$s" == mix* || "$s" == alloc* ]]
}

if all_alive && node_ready; then
    log "already up (pids in $STATE_DIR/pids)"; exit 0
fi

t0=$(date +%s)
# ---- packages --------------------------------------------------------------------------
need=()
for cmd_pkg in munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client; do
    command -v "${cmd_pkg%%:*}" >/dev/null 2>&1 || need+=("${cmd_pkg#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# ---- leftovers of an earlier run of ours -------------------------------------------------
if [ -f "$STATE_DIR/pids" ]; then
    log "some recorded daemons are dead or the node is down: restarting ours"
    "$(dirname "$0")/down.sh"
fi
mkdir -p "$STATE_DIR"
: >"$STATE_DIR/pids"

if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF" && [ "${ZNNI_SLURM_FORCE:-0}" != 1 ]; then
    die "$CONF exists and was not written by this script; refusing to overwrite (set ZNNI_SLURM_FORCE=1 to replace it)"
fi

# ---- munge -------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
chmod 755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then   # reuse a working munged
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
    echo "munged $(cat /run/munge/munged.pid)" >>"$STATE_DIR/pids"
fi
munge -n | unmunge >/dev/null || die "munge does not work"

# ---- slurm.conf --------------------------------------------------------------------------
# Hardware from slurmd -C; RealMemory ~90% of what it detects, leaving room for the OS.
read -r CPUS SOCKETS CORES THREADS MEM < <(slurmd -C | head -n1 | awk '
    {for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }}
    END {print v["CPUs"], (v["Boards"] ? v["Boards"] : 1) * v["SocketsPerBoard"],
               v["CoresPerSocket"], v["ThreadsPerCore"], v["RealMemory"]}')
REALMEM=$(( MEM * 9 / 10 ))
STATE_SAVE=$STATE_DIR/ctld; SPOOL=$STATE_DIR/d
# A StateSaveLocation left by another ClusterName stops slurmctld: always start clean.
# Job ids restart at 1 with it, so the job completion log (read by `sacct -c`) starts clean too.
rm -rf "$STATE_SAVE" "$SPOOL" /var/log/slurm/jobcomp.log; mkdir -p "$STATE_SAVE" "$SPOOL" "$CONF_DIR" /var/log/slurm
cat >"$CONF" <<EOF
$MARK; regenerated on every start
ClusterName=znni-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE_SAVE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=300
KillWait=5
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=500
EnforcePartLimits=ALL
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
JobAcctGatherParams=OverMemoryKill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS RealMemory=$REALMEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF

# ---- daemons -----------------------------------------------------------------------------
start() {  # name pidfile cmd...
    local name=$1 pidfile=$2; shift 2
    rm -f "$pidfile"
    "$@"
    for _ in $(seq 100); do [ -s "$pidfile" ] && break; sleep 0.1; done
    [ -s "$pidfile" ] || die "$name did not start: see /var/log/slurm/$name.log"
    echo "$name $(cat "$pidfile")" >>"$STATE_DIR/pids"
}
start slurmctld "$STATE_DIR/slurmctld.pid" /usr/sbin/slurmctld -i
start slurmd "$STATE_DIR/slurmd.pid" /usr/sbin/slurmd -N "$HOST"

for _ in $(seq 150); do node_ready && break; sleep 0.2; done
node_ready || { sinfo -N >&2 || true; die "node $HOST is not idle; see /var/log/slurm/*.log"; }
log "up in $(( $(date +%s) - t0 )) s: $(sinfo -h -N -o '%N %t cpus=%c mem=%m')"
