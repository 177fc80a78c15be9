"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd started as root, torn down after.

Debian's slurm-wlm and munge (scripts/install.sh installs them in test mode). The node declares the
machine's real CPUs and memory; the partition oversubscribes cores so the run's jobs (core, learner,
generators) all fit on a 2-core CI machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from asyncrl.launch.redis_server import free_port

CONF = """\
ClusterName=asyncrltest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=60
InactiveLimit=0
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:16
"""


def missing() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "the one-node Slurm cluster needs root (slurmd runs jobs as their user)"
    for exe in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(exe) is None:
            return f"{exe} not found: bash scripts/install.sh test installs slurm-wlm and munge"
    return None


class SlurmCluster:
    def __init__(self, base: Path):
        self.dir = base
        self.procs: list[subprocess.Popen] = []
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"

    def start(self, timeout_s: float = 90.0) -> SlurmCluster:
        for sub in ("state", "spool", "munge"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
        self.conf.write_text(CONF.format(host=self.host, ctld_port=free_port(), slurmd_port=free_port(),
                                         dir=self.dir, cpus=os.cpu_count(), mem_mb=mem_mb))
        os.environ["SLURM_CONF"] = str(self.conf)
        # munged with its own socket: no clash with a system one or another test's.
        self.munge_socket = self.dir / "munge" / "munge.socket"
        os.environ["MUNGE_SOCKET"] = str(self.munge_socket)  # not read by Slurm; kept for munge tools
        self._spawn(["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                     f"--pid-file={self.dir / 'munge' / 'munged.pid'}", f"--seed-file={self.dir / 'munge' / 'seed'}",
                     f"--log-file={self.dir / 'munge' / 'munged.log'}"])
        self._wait(lambda: self.munge_socket.exists(), 20, "munged")
        with open(self.conf, "a") as f:  # Slurm talks to our munged
            f.write(f"AuthInfo=socket={self.munge_socket}\n")
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(self._node_idle, timeout_s, "the Slurm node to be idle")
        return self

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.dir / f"{Path(argv[0]).name}.out", "ab")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _node_idle(self) -> bool:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
        return res.returncode == 0 and res.stdout.strip().startswith(("idle", "mixed", "allocated"))

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok():
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}: {self.logs()}")
            time.sleep(0.5)
        raise TimeoutError(f"waited {timeout_s}s for {what}: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-2000:]}" for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")))

    def job_state(self, job: str, retry_s: float = 60.0) -> str:
        """The job's state; GONE once slurmctld no longer knows the job. A busy slurmctld that does not
        answer (that is not a job that left) is asked again for up to `retry_s`, then UNKNOWN."""
        deadline = time.monotonic() + retry_s
        while True:
            res = subprocess.run(["scontrol", "show", "job", str(job), "-o"], capture_output=True, text=True)
            for part in res.stdout.split():
                if part.startswith("JobState="):
                    return part.split("=", 1)[1]
            if "Invalid job id" in res.stderr:
                return "GONE"
            if time.monotonic() >= deadline:
                return "UNKNOWN"
            time.sleep(1)

    def state_when_ended(self, job: str, timeout_s: float) -> str | None:
        """The job's final state once it has one (COMPLETED, FAILED, CANCELLED, ...; GONE), or None if it
        had none within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"):
                return state
            time.sleep(2)
        return None

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], capture_output=True)
        time.sleep(1)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        os.environ.pop("SLURM_CONF", None)


def job_processes(job: str) -> list[str]:
    """`pid cmdline` of every process whose environment says it belongs to Slurm job `job` (Slurm sets
    SLURM_JOB_ID for the batch script, and everything it starts inherits it: the role, its engine or
    ranks, a redis-server in a session of its own)."""
    needle = f"SLURM_JOB_ID={job}".encode() + b"\0"
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes() + b"\0":
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                out.append(f"{d.name} {cmd[:160]}")
        except OSError:  # gone meanwhile
            continue
    return out
