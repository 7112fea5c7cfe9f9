#!/usr/bin/env bash
# A real Slurm cluster on this one machine: two virtual nodes (one slurmd each, distinct ports), a controller,
# accounting through slurmdbd + MariaDB (NeMo-Run reads job states with sacct), authentication by munge on a
# private socket. Everything lives under one work directory; the only system file touched is /etc/hosts, where the
# nodes' names are added (torchrun's rendezvous and srun resolve them) and removed again at stop.
#
#   bash scripts/slurm_cluster.sh start [DIR]    # installs the Debian packages if missing; prints the env to use
#   bash scripts/slurm_cluster.sh stop [DIR]     # stops every daemon it started (by pid), removes its hosts lines
#   bash scripts/slurm_cluster.sh env [DIR]      # the environment: export SLURM_CONF=...
#
# DIR defaults to $SLURM_CLUSTER_DIR or /tmp/megatron-kl-slurm. Needs root (the daemons run as root here), which
# CI and a container have; on a workstation run it in a container or VM. Nodes: mkl-n1, mkl-n2 (2 CPUs each,
# sharing this machine's cores); partition: ci (default); account: ci.
set -euo pipefail
action=${1:-start}
dir=$(realpath -m "${2:-${SLURM_CLUSTER_DIR:-/tmp/megatron-kl-slurm}}")
nodes=(mkl-n1 mkl-n2)
ctld_port=${SLURM_CLUSTER_PORT:-16817}
dbd_port=$((ctld_port + 2))
db_port=$((ctld_port + 3))
node_port0=$((ctld_port + 10))
hosts_tag="# megatron-kl slurm_cluster $dir"
socket="$dir/munge/munge.socket"
export SLURM_CONF="$dir/etc/slurm.conf"

log() { echo "slurm_cluster: $*" >&2; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v munged >/dev/null \
        && command -v mariadbd >/dev/null && return 0
    log "installing slurm-wlm, slurmdbd, munge, mariadb-server"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurm-wlm slurmdbd munge mariadb-server mariadb-client >"$dir/log/apt.log" 2>&1 || {
        DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$dir/log/apt.log" 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            slurm-wlm slurmdbd munge mariadb-server mariadb-client >>"$dir/log/apt.log" 2>&1
    }
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2 start
    shift 2
    start=$(date +%s)
    until "$@" >/dev/null 2>&1; do
        if [ $(( $(date +%s) - start )) -ge "$limit" ]; then
            log "timed out after ${limit}s waiting for $what"
            return 1
        fi
        sleep 0.5
    done
}

write_configs() {
    local cpus=2 node port i
    mkdir -p "$dir"/{etc,state,run,log,munge,db} "$dir"/spool/{mkl-n1,mkl-n2}
    cat >"$dir/etc/slurm.conf" <<EOF
ClusterName=megatronkl
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$dbd_port
AccountingStoragePass=$socket
AccountingStorageEnforce=associations
JobCompType=jobcomp/none
EOF
    for i in "${!nodes[@]}"; do
        node=${nodes[$i]}
        port=$((node_port0 + i))
        echo "NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node Port=$port CPUs=$cpus RealMemory=2000 State=UNKNOWN" \
            >>"$dir/etc/slurm.conf"
    done
    echo "PartitionName=ci Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" \
        >>"$dir/etc/slurm.conf"
    cat >"$dir/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$socket
DbdHost=localhost
DbdPort=$dbd_port
SlurmUser=root
PidFile=$dir/run/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=megatronkl
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$dir/etc/slurmdbd.conf"
    : >"$dir/etc/cgroup.conf"
}

start_munge() {
    [ -s "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; }
    chmod 700 "$dir/munge"
    chmod 400 "$dir/munge/munge.key"
    munged --force --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/run/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
    wait_for 20 munged test -S "$socket"
}

start_mariadb() {
    if [ ! -d "$dir/db/mysql" ]; then
        mariadb-install-db --datadir="$dir/db" --user=root --auth-root-authentication-method=socket \
            --skip-test-db >"$dir/log/mariadb-install.log" 2>&1
    fi
    setsid mariadbd --datadir="$dir/db" --socket="$dir/run/mysqld.sock" --port="$db_port" \
        --bind-address=127.0.0.1 --user=root --pid-file="$dir/run/mariadbd.pid" --skip-name-resolve \
        --log-error="$dir/log/mariadbd.log" </dev/null >/dev/null 2>&1 &
    wait_for 60 mariadbd mariadb --socket="$dir/run/mysqld.sock" -uroot -e "select 1"
    mariadb --socket="$dir/run/mysqld.sock" -uroot -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'megatronkl';
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        FLUSH PRIVILEGES;"
}

add_hosts() {
    remove_hosts
    for node in "${nodes[@]}"; do
        echo "127.0.0.1 $node $hosts_tag" >>/etc/hosts
    done
}

remove_hosts() {
    [ -w /etc/hosts ] || return 0
    if grep -qF "$hosts_tag" /etc/hosts; then
        grep -vF "$hosts_tag" /etc/hosts >"$dir/run/hosts.new" || true
        cat "$dir/run/hosts.new" >/etc/hosts  # in place: /etc/hosts may be a bind mount
        rm -f "$dir/run/hosts.new"
    fi
}

cluster_ready() {
    local idle
    idle=$(sinfo -h -N -p ci -o "%N %T" 2>/dev/null | grep -c " idle" || true)
    [ "$idle" -ge "${#nodes[@]}" ]
}

start() {
    if [ -s "$dir/run/slurmctld.pid" ] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
        log "already running ($dir)"
        print_env
        return 0
    fi
    mkdir -p "$dir/log"
    install_packages
    write_configs
    add_hosts
    start_munge
    start_mariadb
    slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster megatronkl >/dev/null 2>&1 || true
    sacctmgr -i add account ci Description=ci Organization=megatron-kl >/dev/null 2>&1 || true
    sacctmgr -i add user root Account=ci DefaultAccount=ci >/dev/null 2>&1 || true
    slurmctld
    wait_for 30 slurmctld scontrol ping
    for node in "${nodes[@]}"; do
        slurmd -N "$node"
    done
    wait_for 60 "both nodes idle" cluster_ready
    log "up: $(sinfo -h -N -p ci -o '%N %T' | tr '\n' ' ')($dir)"
    print_env
}

stop_pid() {  # stop_pid NAME PIDFILE
    local pidfile=$2 pid
    [ -s "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 40); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

stop() {
    # jobs first (their slurmstepd children end with them), then the daemons, newest first
    if [ -f "$SLURM_CONF" ] && [ -s "$dir/run/slurmctld.pid" ]; then
        scancel --partition=ci --full >/dev/null 2>&1 || true
        sleep 1
    fi
    for node in "${nodes[@]}"; do
        stop_pid "slurmd $node" "$dir/run/slurmd-$node.pid"
    done
    pkill -f "slurmstepd: \[.*\]" 2>/dev/null || true  # a step whose slurmd is gone
    stop_pid slurmctld "$dir/run/slurmctld.pid"
    stop_pid slurmdbd "$dir/run/slurmdbd.pid"
    stop_pid mariadbd "$dir/run/mariadbd.pid"
    stop_pid munged "$dir/run/munged.pid"
    remove_hosts
    log "stopped ($dir)"
}

print_env() {
    echo "export SLURM_CONF=$SLURM_CONF"
}

case "$action" in
    start) start ;;
    stop) stop ;;
    env) print_env ;;
    *) echo "usage: $0 start|stop|env [DIR]" >&2; exit 2 ;;
esac
