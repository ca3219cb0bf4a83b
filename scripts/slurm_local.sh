#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (localhost), for kvbench's slurm tests (tests/slurm)
# and for trying `kvbench -m hydra/launcher=slurm ...` before a real cluster (docs/slurm.md).
#
#   scripts/slurm_local.sh install   # apt-get install slurm-wlm munge slurmdbd mariadb-server (as root)
#   scripts/slurm_local.sh start     # configure, start every daemon, wait until the node is idle
#   scripts/slurm_local.sh status    # sinfo
#   scripts/slurm_local.sh stop      # stop every daemon start started (jobs still running are killed)
#
# The node is this machine as `slurmd -C` reads it (its real CPUs and memory), in one partition
# `debug` with a 10-minute default time limit. Process tracking and tasks use plugins that need
# no cgroups (proctrack/linuxproc, task/none), so it runs in a container. Accounting (slurmdbd on
# a MariaDB of its own) is there because submitit asks `sacct` what became of a job that left no
# result (a time limit, a scancel): without it a sweep would wait for such a job forever.
# KillWait is 5 s: SLURM's SIGTERM is followed by SIGKILL 5 s later (30 s by default).
#
# Needs root (the daemons, /etc/slurm). Writes /etc/slurm/slurm.conf and slurmdbd.conf only where
# there are none or this script wrote them; state and logs go to $KVBENCH_SLURM_DIR
# (default /var/tmp/kvbench-slurm). Exit status non-zero with the reason on stderr.
set -euo pipefail

STATE=${KVBENCH_SLURM_DIR:-/var/tmp/kvbench-slurm}
ETC=/etc/slurm
MARK="# written by kvbench scripts/slurm_local.sh"
PARTITION=debug
DB_SOCKET=/run/mysqld/mysqld.sock  # where slurmdbd's MariaDB client looks for localhost

die() { echo "slurm_local.sh: $*" >&2; exit 1; }
log_tail() { for f in "$@"; do [ -f "$f" ] && { echo "--- $f (last lines)" >&2; tail -n 15 "$f" >&2; }; done; return 0; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else die "needs root (or sudo) for: $*"; fi; }

# Wait up to $1 seconds for the command after it to succeed.
wait_for() {
  local limit=$1; shift
  local end=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.5
  done
}

install() {
  local missing=()
  for tool in munged slurmctld slurmd slurmdbd sbatch srun sacct mariadbd; do
    command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] && { echo "slurm_local.sh: SLURM, munge and MariaDB are installed"; return 0; }
  command -v apt-get >/dev/null || die "no apt-get here to install ${missing[*]}: install SLURM (slurmctld, slurmd, slurmdbd), munge and MariaDB with this system's package manager, then run: $0 start"
  echo "slurm_local.sh: installing slurm-wlm munge slurmdbd mariadb-server (missing: ${missing[*]})"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge slurmdbd mariadb-server >/dev/null
}

# Write $2 to $1 unless $1 exists and was not written by this script.
write_conf() {
  local path=$1 text=$2
  if [ -e "$path" ] && ! grep -qF "$MARK" "$path"; then
    die "$path exists and was not written by this script: this machine has a SLURM of its own (use it, or move $path away)"
  fi
  printf '%s\n%s\n' "$MARK" "$text" > "$path"
}

configure() {
  local node host
  node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=... RealMemory=...: this machine as slurmd sees it
  host=${node#NodeName=}; host=${host%% *}
  mkdir -p "$ETC" "$STATE"/{ctld,spool,mysql} /run/munge /run/mysqld
  write_conf "$ETC/slurm.conf" "ClusterName=kvbench
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES DefaultTime=10 MaxTime=INFINITE State=UP"
  write_conf "$ETC/slurmdbd.conf" "DbdHost=localhost
SlurmUser=root
AuthType=auth/munge
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=kvbench_slurm_acct"
  chmod 600 "$ETC/slurmdbd.conf"
  # munge: one key for this host (the package makes one; make it where it did not)
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key /run/munge
  chmod 400 /etc/munge/munge.key
  chown mysql:mysql "$STATE/mysql" /run/mysqld
  [ -d "$STATE/mysql/mysql" ] || mariadb-install-db --user=mysql --datadir="$STATE/mysql" \
    --auth-root-authentication-method=socket >"$STATE/mariadb-install.log" 2>&1 \
    || { log_tail "$STATE/mariadb-install.log"; die "mariadb-install-db failed"; }
}

start() {
  [ "$(id -u)" = 0 ] || die "start needs root (the daemons and /etc/slurm); run it with sudo"
  for tool in munged slurmctld slurmd slurmdbd mariadbd sinfo; do
    command -v "$tool" >/dev/null || die "$tool is not installed: run $0 install"
  done
  configure
  if ! munge -n </dev/null >/dev/null 2>&1; then
    runuser -u munge -- munged || die "munged did not start (see /var/log/munge/munged.log)"
    wait_for 10 munge -n || die "munge does not answer"
  fi
  if ! mariadb-admin --socket="$DB_SOCKET" ping >/dev/null 2>&1; then
    (mariadbd --user=mysql --datadir="$STATE/mysql" --socket="$DB_SOCKET" --skip-networking \
       --log-error="$STATE/mysql/mariadb.log" --pid-file=/run/mysqld/mariadb.pid >/dev/null 2>&1 &)
    wait_for 30 mariadb-admin --socket="$DB_SOCKET" ping || { log_tail "$STATE/mysql/mariadb.log"; die "MariaDB did not start"; }
  fi
  if ! sacctmgr -n list cluster >/dev/null 2>&1; then
    slurmdbd || { log_tail "$STATE/slurmdbd.log"; die "slurmdbd did not start"; }
    wait_for 30 sacctmgr -n list cluster || { log_tail "$STATE/slurmdbd.log"; die "slurmdbd does not answer"; }
  fi
  sacctmgr -n list cluster format=cluster | grep -qw kvbench || sacctmgr -i add cluster kvbench >/dev/null
  if ! scontrol ping 2>/dev/null | grep -q UP; then
    slurmctld || { log_tail "$STATE/slurmctld.log"; die "slurmctld did not start"; }
  fi
  wait_for 30 sh -c 'scontrol ping | grep -q UP' || { log_tail "$STATE/slurmctld.log"; die "slurmctld does not answer"; }
  [ -f "$STATE/slurmd.pid" ] && kill -0 "$(cat "$STATE/slurmd.pid")" 2>/dev/null \
    || slurmd || { log_tail "$STATE/slurmd.log"; die "slurmd did not start"; }
  if ! wait_for 60 sh -c "sinfo -h -p $PARTITION -o %T | grep -qx idle"; then
    scontrol update nodename=ALL state=resume 2>/dev/null || true  # a node left down by an earlier run
    wait_for 20 sh -c "sinfo -h -p $PARTITION -o %T | grep -qx idle" || {
      sinfo -N -l >&2 || true; log_tail "$STATE/slurmctld.log" "$STATE/slurmd.log"
      die "the node never became idle (sinfo above)"; }
  fi
  echo "slurm_local.sh: SLURM is up: $(sinfo -h -N -o '%N %T %c CPUs %m MB, partition %P, default time %L')"
}

stop() {
  local pids=() pidfile pid
  for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$STATE/slurmdbd.pid" /run/mysqld/mariadb.pid; do
    [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")")
  done
  scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
  wait_for 20 sh -c '[ -z "$(squeue -h 2>/dev/null)" ]' || true  # let slurmd end the jobs' steps
  scontrol shutdown >/dev/null 2>&1 || true  # slurmctld and slurmd
  for pid in "${pids[@]}"; do  # in that order: the database last
    kill "$pid" 2>/dev/null || true
    wait_for 20 sh -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
  done
  rm -f "$STATE"/*.pid /run/mysqld/mariadb.pid
  [ -f /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
  echo "slurm_local.sh: stopped"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 install|start|status|stop" >&2; exit 2 ;;
esac
