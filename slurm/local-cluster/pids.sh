# Sourced by start.sh and stop.sh. A pid file outlives its daemon (a killed container, a crash, a
# reboot), and its number soon belongs to another process: trusting it, start.sh would skip a
# daemon that is not running and stop.sh would kill a stranger. So a daemon counts as running only
# when the process under that number runs the program the file is named for (slurmd-node1.pid:
# slurmd; slurmctld.pid: slurmctld; munged.pid: munged) and has not ended: a daemon killed a moment
# ago is a zombie until it is reaped, with its name still in /proc.

daemon_pid() {  # daemon_pid PIDFILE: print its pid when that process is the file's daemon, running
  local name pid stat
  name=$(basename "$1" .pid)
  name=${name%%-*}
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }  # the fields after the command name, which may itself hold ") "
  [[ ${stat%% *} != Z ]] || return 1
  echo "$pid"
}

alive() {  # alive PIDFILE: the file's daemon is running
  daemon_pid "$1" >/dev/null
}
