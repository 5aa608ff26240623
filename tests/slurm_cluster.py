"""A one-machine SLURM for the tests: munged, slurmctld and slurmd of Debian's `munge` and
`slurm-wlm` packages, each started in the foreground from a fresh directory under /tmp with a
configuration of its own, on loopback ports picked free, and stopped at the end.

Nothing of the machine's own SLURM or munge is used or changed: the munge key, its socket, the
SLURM state and spool directories and the logs are all in that directory, and the clients
(sbatch, squeue, scancel) find the configuration through `SLURM_CONF`, which `env()` gives.
Where the programs are missing or the cluster does not come up, `start()` raises
`SlurmUnavailable` with the reason, which the tests turn into a skip (a failure under
DSGD_REQUIRE_SLURM=1, as .ci/run sets).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin")


class SlurmUnavailable(Exception):
    """Why a one-machine SLURM cannot be started here."""


def find(program: str) -> str | None:
    """The program's path: in PATH, or in the sbin directories a non-root PATH may lack."""
    return shutil.which(program) or next(
        (f"{d}/{program}" for d in SBIN if os.access(f"{d}/{program}", os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class SlurmCluster:
    directory: Path
    cpus: int
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    def env(self) -> dict[str, str]:
        """The environment under which SLURM's clients talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client (`squeue ...`) run against this cluster."""
        result = subprocess.run([find(args[0]) or args[0], *args[1:]], capture_output=True,
                                text=True, timeout=60, env={**os.environ, **self.env()})
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")
        return result

    def queued_tasks(self) -> list[str]:
        """The jobs and array tasks still pending or running, one `JOBID STATE` line each."""
        return self.command("squeue", "-h", "-r", "-o", "%i %T").stdout.split("\n")[:-1]

    def wait_until_idle(self, timeout: float) -> None:
        """Return once no job is queued or running; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.queued_tasks():
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM jobs still queued after {timeout:.0f} s: "
                                   f"{self.queued_tasks()}; {self.logs_tail()}")
            time.sleep(0.5)

    def logs_tail(self) -> str:
        return " | ".join(f"{log.name}: {log.read_text()[-1500:]}"
                          for log in sorted(self.directory.glob("*.log")))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def slurm_conf(directory: Path, cpus: int) -> str:
    """One controller and one node on this machine, talking over loopback only."""
    host = socket.gethostname().split(".")[0]  # slurmctld checks that it is SlurmctldHost
    user = "root" if os.geteuid() == 0 else os.environ.get("USER") or "nobody"
    return f"""\
ClusterName=dsgdtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={directory}/munge.socket
CredType=cred/munge
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=30
MinJobAge=300
MaxArraySize=10001
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def start(cpus: int | None = None, timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and slurmd with a node of `cpus` CPUs (the machine's; more are
    taken as configured: config_overrides); SlurmUnavailable where that cannot be done."""
    missing = [program for program in DAEMONS if find(program) is None]
    if missing:
        raise SlurmUnavailable(f"SLURM is not installed: no {', '.join(missing)} "
                               "(apt-get install slurm-wlm munge)")
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="dsgd-slurm-", dir="/tmp")),
                           cpus or os.cpu_count() or 1)
    try:
        _start_munge(cluster)
        _start_slurm(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_munge(cluster: SlurmCluster) -> None:
    directory = cluster.directory
    directory.chmod(0o700)  # munged refuses a key or socket directory others may write to
    key = directory / "munge.key"
    _checked([find("mungekey"), "--create", f"--keyfile={key}"], "mungekey")
    socket_path = directory / "munge.socket"
    cluster.processes.append(subprocess.Popen(
        [find("munged"), "--foreground", "--force", f"--socket={socket_path}",
         f"--key-file={key}", f"--pid-file={directory}/munged.pid",
         f"--seed-file={directory}/munged.seed", f"--log-file={directory}/munged.log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_for(lambda: socket_path.exists(), 10, "munged did not start", cluster)


def _start_slurm(cluster: SlurmCluster, timeout: float) -> None:
    directory = cluster.directory
    (directory / "state").mkdir()
    (directory / "spool").mkdir()
    cluster.conf.write_text(slurm_conf(directory, cluster.cpus))
    env = {**os.environ, **cluster.env()}
    for daemon in ("slurmctld", "slurmd"):
        # -D: in the foreground, a child of this process; -i: ignore state a crash left.
        options = ["-D", "-i"] if daemon == "slurmctld" else ["-D"]
        cluster.processes.append(subprocess.Popen(
            [find(daemon), *options, "-f", str(cluster.conf)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_for(lambda: _node_ready(cluster), timeout, "the SLURM node did not come up", cluster)


def _node_ready(cluster: SlurmCluster) -> bool:
    for process in cluster.processes:
        if process.poll() is not None:
            raise SlurmUnavailable(f"{process.args[0]} exited with code {process.returncode}: "
                                   f"{cluster.logs_tail()}")
    result = cluster.command("sinfo", "-h", "-o", "%T", check=False)
    return result.returncode == 0 and result.stdout.strip() in ("idle", "mixed", "allocated")


def _checked(command: list[str], name: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise SlurmUnavailable(f"{name} failed: {result.stderr.strip()}")


def _wait_for(ready, timeout: float, failure: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"{failure} within {timeout:.0f} s: {cluster.logs_tail()}")
        time.sleep(0.2)
