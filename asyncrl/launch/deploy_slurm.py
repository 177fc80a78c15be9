"""`asyncrl submit slurm`: the run as Slurm jobs, rendered from asyncrl/templates/slurm/*.sbatch.

- job 1 (`core`): Redis + the buffer on one node; publishes the Redis address in `{run_dir}/redis_url`;
- the learner: `srun torchrun` across `--learner-nodes` nodes;
- one job per generator (name `asyncrl-{run}-gen-{id}`), so `asyncrl scale` and `scancel` act on one
  generator: scale-down is `scancel --batch --signal=TERM` (the generator drains, then exits 0).

Every job reads the resolved config from `{run_dir}/config.yaml` and runs in the directory `asyncrl
submit` ran in, where the config's relative paths (`run.dir`, `model.path`, `data.path`) point; the
run directory and that directory must be on a filesystem all nodes share, and the Python that
submitted (`sys.executable`, with asyncrl installed in it, from a wheel or a checkout) must run on
every node. Logs: `{run_dir}/logs/{role}-{jobid}.log`.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from asyncrl.config import Config, dump_yaml

log = logging.getLogger(__name__)

TEMPLATES = Path(str(resources.files("asyncrl") / "templates" / "slurm"))  # package data: *.sbatch


@dataclass
class SlurmPlan:
    num_generators: int
    learner_nodes: int = 1
    gpus_per_node: int = 0
    partition: str = ""


def _sbatch_lines(cfg: Config, plan: SlurmPlan) -> str:
    lines = [f"#SBATCH --partition={plan.partition}"] if plan.partition else []
    lines += [f"#SBATCH {x}" for x in cfg.deploy.slurm_extra]
    return "\n".join(lines)


def render(name: str, cfg: Config, plan: SlurmPlan, config_path: Path) -> str:
    run_dir = cfg.run_dir.resolve()
    gpus = {"learner": plan.gpus_per_node, "generator": cfg.generator.tensor_parallel_size if plan.gpus_per_node else 0,
            "core": 0}[name]
    values = {
        "RUN": cfg.run.name, "RUN_DIR": str(run_dir), "LOGS": str(run_dir / "logs"), "CONFIG": str(config_path),
        "PYTHON": sys.executable, "WORKDIR": str(Path.cwd()), "TIME": cfg.deploy.slurm_time,
        "NODES": str(plan.learner_nodes), "NPROC": str(cfg.learner.nproc),
        "CPUS": str(cfg.learner.nproc if name == "learner" else cfg.generator.cpu_threads),
        # One learner node: its rendezvous stays on localhost; several: the first node of the allocation.
        "HEAD": "127.0.0.1" if plan.learner_nodes == 1 else
                '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        # Bound to all interfaces: the learner publishes its weight-group store under the node's name.
        "NODE_OVERRIDES": '"deploy.bind_host=$(hostname)"' if cfg.deploy.bind_host in ("0.0.0.0", "::") else "",
        "SBATCH_GPUS": f"#SBATCH --gpus-per-node={gpus}" if gpus else "",
        "SBATCH_EXTRA": _sbatch_lines(cfg, plan),
    }
    text = (TEMPLATES / f"{name}.sbatch").read_text()
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    assert "@@" not in text, f"unrendered placeholder in {name}.sbatch"
    return text


def write_scripts(cfg: Config, plan: SlurmPlan) -> dict[str, Path]:
    run_dir = cfg.run_dir.resolve()
    out = run_dir / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_yaml(cfg))
    paths = {}
    for name in ("core", "learner", "generator"):
        paths[name] = out / f"{name}.sbatch"
        paths[name].write_text(render(name, cfg, plan, config_path))
    return paths


def _next_generator_ids(run_dir: Path, num: int) -> list[str]:
    """Fresh generator ids, never reused in a run (a counter file under a lock: concurrent scales)."""
    counter = run_dir / "slurm" / "next_generator"
    with open(run_dir / "slurm" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        start = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(start + num))
    return [f"g{i}" for i in range(start, start + num)]


def _sbatch(args: list[str]) -> str:
    exe = shutil.which("sbatch")
    if exe is None:
        raise FileNotFoundError("sbatch not found: run this on a Slurm login node (Debian: apt-get install slurm-client)")
    res = subprocess.run([exe, "--parsable", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} failed: {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]


def submit_generators(cfg: Config, num: int) -> dict[str, str]:
    run_dir = cfg.run_dir.resolve()
    script = run_dir / "slurm" / "generator.sbatch"
    jobs = {}
    for gid in _next_generator_ids(run_dir, num):
        jobs[gid] = _sbatch([f"--job-name=asyncrl-{cfg.run.name}-gen-{gid}",
                             f"--output={run_dir}/logs/generator-{gid}-%j.log",
                             f"--export=ALL,ASYNCRL_GEN_ID={gid}", str(script)])
    return jobs


def submit_slurm(cfg: Config, plan: SlurmPlan, dry_run: bool = False) -> dict[str, str]:
    """Renders and submits (or, dry run, prints) the run's jobs; returns role -> job id."""
    if dry_run:
        config_path = cfg.run_dir.resolve() / "config.yaml"
        for name in ("core", "learner", "generator"):
            print(f"# ---- {name}.sbatch ----")
            print(render(name, cfg, plan, config_path))
        print(f"# {plan.num_generators} generator job(s): sbatch --job-name=asyncrl-{cfg.run.name}-gen-gN "
              "--export=ALL,ASYNCRL_GEN_ID=gN generator.sbatch")
        return {}
    run_dir = cfg.run_dir.resolve()
    (run_dir / "slurm" / "next_generator").unlink(missing_ok=True)
    from asyncrl.protocol.security import redis_url_file

    redis_url_file(run_dir).unlink(missing_ok=True)  # an earlier run's address must not be read
    paths = write_scripts(cfg, plan)
    jobs = {"core": _sbatch([str(paths["core"])]), "learner": _sbatch([str(paths["learner"])])}
    jobs.update(submit_generators(cfg, plan.num_generators))
    return jobs


def generator_jobs(run: str) -> list[tuple[int, str, str]]:
    """(job id, generator id, state) of this run's generator jobs still queued or running, oldest first."""
    res = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T"], capture_output=True, text=True, check=True)
    prefix = f"asyncrl-{run}-gen-"
    jobs = []
    for line in res.stdout.splitlines():
        job, name, state = line.strip().split("|")
        if name.startswith(prefix) and state in ("PENDING", "RUNNING", "CONFIGURING"):
            jobs.append((int(job), name.removeprefix(prefix), state))
    return sorted(jobs)


def scale_slurm(cfg: Config, client, keys, delta: int) -> str:
    from asyncrl.protocol.keys import log_event

    if delta > 0:
        jobs = submit_generators(cfg, delta)
        for gid, job in jobs.items():
            log_event(client, keys, "scale_up", id=gid, backend="slurm", job=job)
        return "submitted " + ", ".join(f"{gid} (job {job})" for gid, job in jobs.items())
    victims = generator_jobs(cfg.run.name)[::-1][:-delta]
    for job, gid, _state in victims:
        # SIGTERM to the batch step only: the script forwards it to the generator, which drains and exits 0.
        signal_args = ["--batch", "--signal=TERM"] if _state == "RUNNING" else []  # a queued job just goes
        subprocess.run(["scancel", *signal_args, str(job)], check=True)
        log_event(client, keys, "scale_down", id=gid, backend="slurm", job=job)
    if len(victims) < -delta:
        log.warning("asked to remove %d generators, only %d are running", -delta, len(victims))
    return "draining " + ", ".join(f"{gid} (job {job})" for job, gid, _ in victims)
