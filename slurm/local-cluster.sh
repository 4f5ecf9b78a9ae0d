#!/bin/bash
# A real one-node Slurm on this machine, for the tests: munge, slurmctld and slurmd on localhost.
#
#   slurm/local-cluster.sh start    # as root; installs Debian's packages if they are missing
#   slurm/local-cluster.sh status   # exit 0 when the node takes jobs
#   slurm/local-cluster.sh stop
#
# The configuration is the smallest that runs jobs without cgroups or accounting (a container
# or a CI box has neither): proctrack/linuxproc, task/none, no slurmdbd. It is written to
# /etc/slurm/slurm.conf only when none is there, or when the one there is this script's own; a
# cluster's real configuration is never touched.
set -euo pipefail

conf=/etc/slurm/slurm.conf
mark="# written by kit's slurm/local-cluster.sh"

ours() { [ ! -e "$conf" ] || head -n 1 "$conf" | grep -qF "$mark"; }

start() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "local-cluster.sh start: run it as root (it starts munged, slurmctld and slurmd)" >&2
        exit 2
    fi
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v sbatch >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
    fi
    if ! ours; then
        echo "local-cluster.sh: $conf exists and is not this script's: leaving it (and this machine's Slurm) alone" >&2
        exit 3
    fi
    local host cpus memory
    host=$(hostname -s)
    cpus=$(nproc)
    memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat > "$conf" <<EOF
$mark
ClusterName=kit
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    # munged runs as its own user, with its socket folder owned by it
    mkdir -p /run/munge
    chown munge:munge /run/munge
    chmod 0755 /run/munge
    if ! pgrep -x munged >/dev/null; then
        runuser -u munge -- /usr/sbin/munged
    fi
    pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
    pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
    for _ in $(seq 60); do
        if status >/dev/null 2>&1; then
            echo "local-cluster.sh: Slurm is up on $host ($cpus CPUs)"
            return 0
        fi
        sleep 0.5
    done
    echo "local-cluster.sh: the node did not come up; the logs:" >&2
    tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
    exit 1
}

status() {
    sinfo -h -N -o "%T" 2>/dev/null | grep -Eq "^(idle|mixed|allocated)"
}

stop() {
    if ! ours; then
        echo "local-cluster.sh: $conf is not this script's: not stopping this machine's Slurm" >&2
        exit 3
    fi
    pkill -x slurmd || true
    pkill -x slurmctld || true
    pkill -x munged || true
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: slurm/local-cluster.sh start|status|stop" >&2; exit 2 ;;
esac
