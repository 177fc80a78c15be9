"""docs/deploy.md's two-node example between real separate hosts: Linux network namespaces A, B and C
on 10.231.0.0/24 (tests/multihost.py). A runs redis-server (password), the buffer (CURVE, run token)
and the learner; B runs the generators, which reach A only through its address; C, with no or
wrong credentials, is refused by Redis, the ingest socket and the learner's fleet check. Every
listener of A and B is on its configured interface (or loopback), none on a wildcard address."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as redispy
import yaml

from asyncrl.config import DEFAULT_CONFIG, load_config
from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol import schema, security
from asyncrl.protocol.keys import Keys
from tests import multihost
from tests.helpers import Procs

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "deploy.md"
MAX_STEPS = 300  # a bound: the test stops the run once the generator started mid-run has contributed
WILDCARD = ("0.0.0.0", "*", "::", "")


@pytest.fixture
def hosts():
    reason = multihost.unavailable()
    if reason:
        pytest.skip(reason)
    multihost.remove_stale()
    h = multihost.Hosts(("a", "b", "c")).start()
    try:
        yield h
    finally:
        h.close()


def docs_example(a: str, b: str, shared: Path) -> tuple[str, str]:
    """The YAML block and the redis-server line of "Worked example: two nodes", for these addresses."""
    section = DOCS.read_text().split("## Worked example: two nodes", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    redis_line = next(line for line in section.splitlines() if line.startswith("redis-server "))

    def local(text):
        return text.replace("10.0.0.1", a).replace("10.0.0.2", b).replace("/shared", str(shared))

    return local(block), local(redis_line).rstrip(" &")


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _rows(path: Path) -> list[dict]:
    return complete_rows(path)


def _handshake(addr: str, configure) -> list[str]:
    """ZeroMQ socket-monitor events of one PUSH connection to `addr` (up to a successful handshake)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    configure(sock)
    mon = sock.get_monitor_socket()
    sock.connect(addr)
    events = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if mon.poll(200):
            event = zmq.Event(recv_monitor_message(mon)["event"]).name
            events.append(event)
            if event == "HANDSHAKE_SUCCEEDED":
                break
    sock.disable_monitor()
    mon.close(0)
    sock.close(0)
    ctx.term()
    return events


def _curve(server_public: Path, client_secret: Path):
    import zmq.auth

    def configure(sock):
        server, _ = zmq.auth.load_certificate(str(server_public))
        public, secret = zmq.auth.load_certificate(str(client_secret))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server
    return configure


def _redis_try(host: str, port: int, password: str | None) -> str:
    try:
        return "ok" if redispy.Redis(host=host, port=port, password=password, socket_timeout=5).ping() else "no"
    except redispy.AuthenticationError as e:
        return f"refused: {e}"


def _refusals_from_c(hosts, a: str, keys_dir: Path, password: str, tmp_path: Path) -> dict:
    """From host C: Redis without and with a wrong password, the ingest socket without credentials
    and with a client key the buffer does not know; each next to the same call with the right
    credentials (so a refusal is the credentials', not an unreachable address)."""
    foreign = tmp_path / "foreign-keys"
    security.generate_keys(foreign)
    server_key = keys_dir / "server.key"
    ingest = f"tcp://{a}:5555"
    with hosts.inside("c"):
        return {
            "redis_none": _redis_try(a, 6379, None),
            "redis_wrong": _redis_try(a, 6379, "wrong-" + password),
            "redis_right": _redis_try(a, 6379, password),
            "ingest_none": _handshake(ingest, lambda s: None),
            "ingest_token_only": _handshake(ingest, lambda s: (setattr(s, "plain_username", b"asyncrl"),
                                                               setattr(s, "plain_password", b"guess"))),
            "ingest_foreign_key": _handshake(ingest, _curve(server_key, foreign / "client.key_secret")),
            "ingest_run_key": _handshake(ingest, _curve(server_key, keys_dir / "client.key_secret")),
        }


def _forge_heartbeat(hosts, a: str, password: str, keys: Keys) -> None:
    """From host C, a generator with the Redis password but not the run token: a heartbeat whose
    token proof is made with a guessed token. The learner must never make it a weight-group member."""
    with hosts.inside("c"):
        client = redispy.Redis(host=a, port=6379, password=password, socket_timeout=5)
        client.hset(keys.gen("evil"), mapping={
            "id": "evil", "state": "generating", "workers": 1, "host": "c", "updated_at": time.time(),
            "schema_version": schema.SCHEMA_VERSION, "token_proof": security.token_proof("guess", "evil")})
        client.expire(keys.gen("evil"), 600)


def _check_listeners(hosts, name: str, expected_ports: set[int]) -> list[tuple[str, str, int]]:
    addr = hosts.addr(name)
    rows = hosts.listeners(name)
    wide = [r for r in rows if r[1] in WILDCARD]
    assert not wide, f"host {name}: listening on a wildcard address: {wide}"
    stray = [r for r in rows if r[1] not in (addr, "127.0.0.1", "::1")]
    assert not stray, f"host {name}: listening beyond {addr} and loopback: {stray}"
    on_link = {port for _, host, port in rows if host == addr}
    assert expected_ports <= on_link, f"host {name}: expected {expected_ports} on {addr}, got {rows}"
    return rows


@pytest.mark.slow
def test_two_node_example_across_namespaces(hosts, tmp_path, tiny_model, record_property):
    a, b = hosts.addr("a"), hosts.addr("b")
    shared = tmp_path / "shared"
    run1 = shared / "run1"
    run1.mkdir(parents=True)
    yaml_block, redis_line = docs_example(a, b, shared)
    py = [sys.executable, "-m", "asyncrl"]
    for argv in (["keys", "generate", "--out", str(run1 / "keys")], ["keys", "token", "--out", str(run1 / "token")]):
        subprocess.run([*py, *argv], check=True, capture_output=True, timeout=120)
    password = secrets.token_urlsafe(24)
    security.write_secret(run1 / "redis.pw", password)
    # The docs' settings added to the tiny run's config, sized for two shared CPU cores.
    sizes = {"model": {"path": tiny_model}, "run": {"max_steps": MAX_STEPS},
             "generator": {"kv_cache_gb": 0.5, "max_concurrent_groups": 4}, "learner": {"nproc": 1}}
    data = _merge(_merge(yaml.safe_load(DEFAULT_CONFIG.read_text()), yaml.safe_load(yaml_block)), sizes)
    cfg_path = run1 / "multi.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    cfg = load_config(cfg_path)
    assert cfg.buffer.redis_url == f"redis://{a}:6379/0" and cfg.deploy.bind_host == a
    keys = Keys(cfg.run.name)
    metrics = cfg.run_dir / "metrics.jsonl"

    procs = Procs(tmp_path)
    timings = {}
    try:
        (tmp_path / "redis").mkdir()
        t_start = time.time()
        procs.spawn("redis", hosts.argv("a", ["bash", "-c", f"exec {redis_line} --dir {tmp_path / 'redis'}"]))
        procs.spawn("buffer", hosts.argv("a", [*py, "buffer", str(cfg_path)]))
        procs.spawn("b0", hosts.argv("b", [*py, "generator", str(cfg_path), "--id", "b0"]))
        procs.spawn("b1", hosts.argv("b", [*py, "generator", str(cfg_path), "--id", "b1"]))

        def wait_for(what, cond, timeout_s=600, watch=("buffer", "b0", "b1")):
            deadline = time.monotonic() + timeout_s
            while True:
                with hosts.inside("a"):
                    client = redispy.Redis(host=a, port=6379, password=password, socket_timeout=5)
                    try:
                        if cond(client):
                            return
                    except redispy.ConnectionError:
                        pass
                    finally:
                        client.close()
                for name in watch:
                    assert procs.procs[name].poll() is None, f"{name} exited:\n{procs.log(name)[-3000:]}"
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.5)

        wait_for("both generators' heartbeats", lambda c: c.exists(keys.gen("b0")) and c.exists(keys.gen("b1")))
        t_learner = time.time()
        procs.spawn("learner", hosts.argv("a", [*py, "learner", str(cfg_path)]))
        learner = procs.procs["learner"]
        while len(_rows(metrics)) < 2:
            assert learner.poll() is None, procs.log("learner")[-4000:]
            assert time.time() - t_learner < 600, "no second step in 600 s"
            time.sleep(0.2)
        first = _rows(metrics)[0]
        timings["start_to_first_step_s"] = first["time"] - t_start
        timings["learner_start_to_first_step_s"] = first["time"] - t_learner

        # A generator on B killed, a third started on B: it joins like on one host.
        procs.kill("b1")
        procs.spawn("b2", hosts.argv("b", [*py, "generator", str(cfg_path), "--id", "b2"]))

        # While the run is live: C is refused; nothing of A or B listens beyond its interface.
        refusals = _refusals_from_c(hosts, a, run1 / "keys", password, tmp_path)
        _forge_heartbeat(hosts, a, password, keys)
        listeners_a = _check_listeners(hosts, "a", {6379, 5555, 29600})
        listeners_b = _check_listeners(hosts, "b", set())

        # Once b2 has been in two batches, the run is stopped as `asyncrl stop` does.
        while sum("b2" in r["generators_in_batch"] for r in _rows(metrics)) < 2:
            assert learner.poll() is None, procs.log("learner")[-4000:]
            assert procs.procs["b2"].poll() is None, procs.log("b2")[-4000:]
            assert time.time() - t_learner < 900, "b2 contributed to no batch in 900 s"
            time.sleep(0.5)
        with hosts.inside("a"):
            client = redispy.Redis(host=a, port=6379, password=password, socket_timeout=5)
            client.set(keys.stop_request, "1")
            client.close()
        assert learner.wait(timeout=300) == 0, procs.log("learner")[-4000:]
        for name in ("buffer", "b0", "b2"):
            assert procs.procs[name].wait(timeout=120) == 0, f"{name}:\n{procs.log(name)[-3000:]}"
        with hosts.inside("a"):
            client = redispy.Redis(host=a, port=6379, password=password, socket_timeout=5)
            events = [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]
            client.close()
    finally:
        procs.close()

    rows = _rows(metrics)
    num_steps = len(rows)
    assert [r["step"] for r in rows] == list(range(1, num_steps + 1)) and num_steps < MAX_STEPS
    # Every push arrived: each generator loaded every version from its first on (the last one may
    # have come after the stop), and each checksum report the learner compared matched what it sent
    # (a version is reported after the step that pushed it: the last one is not in a row).
    assert rows[-1]["weights_mismatch"] == 0 and rows[-1]["weights_verified"] >= num_steps - 1, rows[-1]
    # A push under way when b1 was killed fails (its peer closed) and the next one re-forms the
    # group without it; any other failed push is a defect. The learner's events carry no `id`; a
    # surviving generator in that push reports its side of the same failure under its own `id`.
    syncs = [e for e in events if e["kind"] == "sync" and "id" not in e]
    failed = [e for e in events if e["kind"] == "sync_failed" and "id" not in e]
    assert len(failed) <= 1 and len(syncs) + len(failed) >= num_steps, (syncs, failed)
    # (it retries the dead epoch's join until the learner has re-formed the group: each try fails)
    gen_failed = [e for e in events if e["kind"] == "sync_failed" and "id" in e]
    assert all(e["id"] in ("b0", "b2") for e in gen_failed), gen_failed
    if gen_failed:
        assert failed, gen_failed
        recovered = min(float(e["t"]) for e in syncs if float(e["t"]) > float(failed[0]["t"]))
        assert all(float(e["t"]) < recovered + 5 for e in gen_failed), (recovered, gen_failed)
    # A failed push's version may reach no one: the learner drops the group and its next step pushes
    # the version after it.
    lost = {int(e["version"]) for e in failed}
    for gid in ("b0", "b2"):
        loaded = [int(v) for v in re.findall(rf"generator {gid} now at version (\d+)", procs.log(gid))]
        # (a re-formed epoch sends the current version again to every member)
        assert loaded, gid
        missing = set(range(loaded[0], max(loaded) + 1)) - set(loaded)
        assert missing <= lost, (gid, loaded, failed)
        assert max(loaded) >= num_steps - 1, (gid, loaded)
    log = procs.log("learner")
    member_lists = re.findall(r"weight group epoch=\d+ members=(\[.*?\])", log)
    assert any("'b0.0'" in m and "'b1.0'" in m for m in member_lists), member_lists
    assert any("'b2.0'" in m and "'b1.0'" not in m for m in member_lists), member_lists
    assert "b2" in {g for r in rows for g in r["generators_in_batch"]}, "b2 never contributed a group"
    assert not any("evil" in m for m in member_lists), member_lists
    assert any(e["kind"] == "auth_refused" and e["id"] == "evil" for e in events), events

    assert refusals["redis_right"] == "ok", refusals
    assert refusals["redis_none"].startswith("refused") and refusals["redis_wrong"].startswith("refused"), refusals
    assert "HANDSHAKE_SUCCEEDED" in refusals["ingest_run_key"], refusals
    for case in ("ingest_none", "ingest_token_only", "ingest_foreign_key"):
        assert "HANDSHAKE_SUCCEEDED" not in refusals[case], (case, refusals)
        assert any(e.startswith("HANDSHAKE_FAILED") for e in refusals[case]), (case, refusals)

    sync_s = sorted(float(e["seconds"]) for e in syncs)
    step_s = [r2["time"] - r1["time"] for r1, r2 in zip(rows, rows[1:], strict=False)]
    timings.update(sync_median_s=sync_s[len(sync_s) // 2], sync_max_s=sync_s[-1],
                   step_median_s=sorted(step_s)[len(step_s) // 2], num_syncs=len(syncs))
    (tmp_path / "timings.json").write_text(json.dumps(timings, indent=1))
    print("multihost timings:", json.dumps(timings), "\nlisteners A:", listeners_a, "\nlisteners B:", listeners_b)
    for k, v in timings.items():
        record_property(k, v)


def test_a_weight_store_bound_to_all_interfaces_publishes_a_reachable_address():
    """Bound to 0.0.0.0, the learner's store publishes deploy.advertise_host (or the host name),
    never 0.0.0.0, which a generator on another node would read as itself."""
    import socket

    from asyncrl.protocol.weight_sync import WeightSender

    for advertise, expected in (("10.231.0.1", "10.231.0.1"), ("", socket.gethostname())):
        sender = WeightSender("0.0.0.0", 0, "gloo", join_timeout_s=5, sync_timeout_s=5, advertise=advertise)
        published = []
        assert sender.open_epoch([], published.append, lambda *a, **k: None) == []
        assert published[0].addr == expected and published[0].port == sender.port
        sender.close()
    assert security.advertised_host("10.231.0.1") == "10.231.0.1"
    assert security.advertised_host("0.0.0.0", "node-a.cluster") == "node-a.cluster"
    assert load_config(None, ["deploy.advertise_host=10.231.0.1"]).deploy.advertise_host == "10.231.0.1"


def test_ray_roles_bind_the_address_of_the_node_ray_placed_them_on():
    from asyncrl.launch.deploy_ray import node_bind_overrides

    assert node_bind_overrides(load_config(None, []), "10.231.0.2") == []  # loopback: one node
    named = load_config(None, ["deploy.bind_host=10.231.0.1", "buffer.bind_host=10.231.0.1"])
    assert node_bind_overrides(named, "10.231.0.2") == ["deploy.bind_host=10.231.0.2", "buffer.bind_host=10.231.0.2"]
    wild = load_config(None, ["deploy.bind_host=0.0.0.0", "buffer.bind_host=0.0.0.0"])
    assert node_bind_overrides(wild, "10.231.0.2") == ["deploy.advertise_host=10.231.0.2"]
    told = load_config(None, ["deploy.bind_host=0.0.0.0", "deploy.advertise_host=node-b"])
    assert node_bind_overrides(told, "10.231.0.2") == []


@pytest.mark.slow
def test_ray_cluster_across_namespaces(hosts, tmp_path, tiny_model, record_property):
    """A Ray head in A and a worker in B (`ray start --address` across the link), each with a custom
    resource of its own; `asyncrl submit ray` from A places the learner on A and the core and the
    generator on B (`--{role}-resources`). The config names A's address as the bind address: the core
    binds B's instead (the node Ray gave it), the learner reaches Redis on B and the generator the
    weight group on A, only through the nodes' addresses; the run trains its steps with every weight
    sync verified. Without a Redis password the core refuses to bind a non-loopback interface: one
    line, the job ends at once."""
    import shutil
    import tempfile

    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'asyncrl[ray]')")
    ray_exe = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    a, b = hosts.addr("a"), hosts.addr("b")
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # Ray's socket paths must stay short
    password = tmp_path / "redis.pw"
    password.write_text(secrets.token_urlsafe(24))
    password.chmod(0o600)
    gcs_port, dashboard_port = 6380, 8265

    def ray_start(host, *args):
        res = subprocess.run(hosts.argv(host, [ray_exe, "start", f"--node-ip-address={hosts.addr(host)}",
                                               "--disable-usage-stats", f"--temp-dir={temp / host}", *args]),
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    def submit(name, *extra):
        argv = [sys.executable, "-m", "asyncrl", "submit", "ray", "configs/tiny.yaml", f"run.dir={tmp_path / 'runs'}",
                f"model.path={tiny_model}", f"run.name={name}", "run.max_steps=4", "learner.nproc=1",
                "generator.backend=hf", "generator.max_tokens=16", "run.stall_timeout_s=0",
                f"deploy.bind_host={a}", f"buffer.bind_host={a}", *extra,
                "--address", f"http://{a}:{dashboard_port}", "--generators", "1", "--cpus-per-role", "1",
                "--core-resources", '{"host_b": 1}', "--learner-resources", '{"host_a": 1}',
                "--generator-resources", '{"host_b": 1}']
        t0 = time.monotonic()
        res = subprocess.run(hosts.argv("a", argv), capture_output=True, text=True, timeout=900, cwd=REPO)
        return res.returncode, res.stdout + res.stderr, time.monotonic() - t0

    def placed(out):
        """role -> the node its actor ran on (Ray marks the lines of actors on other nodes with ip=)."""
        where = {}
        for line in out.splitlines():
            m = re.search(r"\[(core|learner-0|gen-g0)\] started pid", line)
            if m:
                where[m.group(1)] = b if f"ip={b}" in line else a
        return where

    t0 = time.monotonic()
    try:
        ray_start("a", "--head", f"--port={gcs_port}", "--num-cpus=1", '--resources={"host_a": 1}',
                  "--include-dashboard=true", f"--dashboard-host={a}", f"--dashboard-port={dashboard_port}")
        ray_start("b", f"--address={a}:{gcs_port}", "--num-cpus=2", '--resources={"host_b": 2}')
        cluster_up_s = time.monotonic() - t0

        code, out, run_s = submit("rayab", f"deploy.redis_password_file={password}")
        assert code == 0 and "learner exited with 0" in out, out[-6000:]
        where = placed(out)
        assert where == {"core": b, "learner-0": a, "gen-g0": b}, (where, out[-4000:])
        for role in ("learner-0", "gen-g0"):  # Redis is published at the core's node's address, B's
            line = next(x for x in out.splitlines() if f"[{role}] started" in x)
            assert f"buffer.redis_url=redis://{b}:" in line, line
        rows = _rows(tmp_path / "runs" / "rayab" / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["generators_in_batch"] == ["g0"] for r in rows)
        assert rows[-1]["weights_mismatch"] == 0 and rows[-1]["weights_verified"] >= 3, rows[-1]

        code, refused, refused_s = submit("raynopw")
        assert code != 0 and "needs deploy.redis_password_file" in refused, refused[-4000:]
        assert "exited with 2 before publishing" in refused, refused[-4000:]
    finally:
        subprocess.run(hosts.argv("b", [ray_exe, "stop", "--force"]), capture_output=True, timeout=120)
        subprocess.run(hosts.argv("a", [ray_exe, "stop", "--force"]), capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    timings = {"ray_cluster_up_s": round(cluster_up_s, 1), "ray_run_4_steps_s": round(run_s, 1),
               "ray_roles_on": where, "ray_refused_without_password_s": round(refused_s, 1)}
    print("ray across namespaces:", json.dumps(timings))
    for k, v in timings.items():
        record_property(k, v)


def test_generator_resources_option_is_checked_with_one_line():
    from asyncrl.launch.deploy_ray import parse_resources

    assert parse_resources("") == {} and parse_resources('{"host_b": 1}') == {"host_b": 1.0}
    for bad, needle in (("{", "not JSON"), ("[1]", "expected an object"), ('{"CPU": 1}', "--cpus-per-role"),
                        ('{"x": 0}', "positive"), ('{"x": "1"}', "positive"), ('{"x": true}', "positive")):
        with pytest.raises(ValueError, match=needle):
            parse_resources(bad)
    res = subprocess.run([sys.executable, "-m", "asyncrl", "submit", "ray", "configs/tiny.yaml", "--address",
                          "http://127.0.0.1:1", "--generator-resources", "{"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "not JSON" in res.stderr, res.stderr
