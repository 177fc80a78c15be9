"""A Prometheus `/metrics` endpoint for every process (buffer, each generator, learner rank 0).

Each role hands its latest numbers to `Exporter.update(dict)`; a custom collector turns the snapshot
into metric families at scrape time, so the names below are the whole, stable contract
(documented in docs/metrics.md; a test checks that every exported name is documented there).
The endpoint binds `logging.prometheus_host` (127.0.0.1 by default) and its URL is published in the
run's `exporters` hash so `asyncrl status` and tests can find it.
"""

from __future__ import annotations

import logging
import threading

from asyncrl.config import Config

log = logging.getLogger(__name__)

# (metric name, kind, help, key in the role's snapshot). kind: gauge | counter.
LEARNER = [
    ("asyncrl_learner_step", "gauge", "optimizer steps taken", "step"),
    ("asyncrl_learner_version", "gauge", "policy version the learner holds", "version"),
    ("asyncrl_learner_tokens_per_second", "gauge", "trained tokens per second of wall time over the last 30 s", "learner_tokens_per_s"),
    ("asyncrl_learner_idle_ratio", "gauge", "fraction of wall time rank 0 waited for data", "idle_ratio"),
    ("asyncrl_learner_sync_seconds", "gauge", "seconds of the last weight broadcast", "sync_s"),
    ("asyncrl_learner_step_seconds", "gauge", "seconds of the last train step", "step_s"),
    ("asyncrl_learner_reward_mean", "gauge", "mean reward of the last batch", "reward_mean"),
    ("asyncrl_learner_loss", "gauge", "loss of the last batch", "loss"),
    ("asyncrl_learner_grad_norm", "gauge", "gradient norm before clipping", "grad_norm"),
    ("asyncrl_learner_buffer_depth", "gauge", "undelivered groups in the buffer after the step", "buffer_depth"),
    ("asyncrl_learner_generators", "gauge", "live generators (heartbeats) seen at the step", "num_generators"),
    ("asyncrl_staleness_lag_mean", "gauge", "mean version lag of the last batch's tokens", "lag_mean"),
    ("asyncrl_staleness_lag_max", "gauge", "max version lag of the last batch's tokens", "lag_max"),
    ("asyncrl_staleness_sample_age_seconds", "gauge", "age of the oldest group in the last batch", "sample_age_s"),
    ("asyncrl_staleness_is_weight_mean", "gauge", "mean truncated IS weight min(pi_prox/mu, C)", "is_weight_mean"),
    ("asyncrl_staleness_is_weight_max", "gauge", "max raw IS weight pi_prox/mu", "is_weight_max"),
    ("asyncrl_staleness_is_ess", "gauge", "effective sample size of the IS weights, fraction of tokens", "ess"),
    ("asyncrl_staleness_clipped_fraction", "gauge", "fraction of tokens where the PPO clip was active", "clip_frac"),
    ("asyncrl_staleness_truncated_fraction", "gauge", "fraction of tokens whose IS weight hit the cap C",
     "is_capped_frac"),
    ("asyncrl_staleness_masked_fraction", "gauge", "fraction of tokens masked out by IS bounds (0: no mask)",
     "masked_frac"),
    ("asyncrl_staleness_dropped_fraction", "gauge", "groups dropped as stale / groups read, since start",
     "dropped_frac"),
    ("asyncrl_staleness_dropped_groups", "counter", "groups dropped as too stale", "dropped_stale"),
]
BUFFER = [
    ("asyncrl_buffer_depth", "gauge", "undelivered trajectory groups", "depth"),
    ("asyncrl_buffer_oldest_age_seconds", "gauge", "age of the oldest undelivered group", "oldest_age_s"),
    ("asyncrl_buffer_groups_per_second", "gauge", "groups stored per second", "groups_per_s"),
    ("asyncrl_buffer_bytes_per_second", "gauge", "frame bytes received per second", "bytes_per_s"),
    ("asyncrl_buffer_groups", "counter", "groups stored", "groups"),
    ("asyncrl_buffer_frames", "counter", "frames received", "frames"),
    ("asyncrl_buffer_bytes", "counter", "frame bytes received", "bytes"),
    ("asyncrl_buffer_dedupes", "counter", "duplicate groups dropped", "dedupes"),
    ("asyncrl_buffer_reclaims", "counter", "prompts re-released after a lease expired", "reclaims"),
    ("asyncrl_buffer_full_pauses", "counter", "times ingest paused at capacity", "full_pauses"),
    ("asyncrl_buffer_trimmed", "counter", "trained groups trimmed from the stream (`buffer.retain_trained_s`)",
     "trimmed"),
    ("asyncrl_buffer_stream_length", "gauge", "entries in the trajectories stream", "stream_len"),
]
GENERATOR = [
    ("asyncrl_generator_version", "gauge", "policy version the generator holds (-1: none)", "version"),
    ("asyncrl_generator_tokens_per_second", "gauge", "generated tokens per second", "tokens_per_s"),
    ("asyncrl_generator_idle_ratio", "gauge", "fraction of time waiting for prompts or weights", "idle_ratio"),
    ("asyncrl_generator_tokens", "counter", "generated tokens", "tokens"),
    ("asyncrl_generator_groups", "counter", "groups pushed", "groups"),
    ("asyncrl_generator_sync_seconds", "counter", "seconds paused for weight updates", "sync_s_total"),
    ("asyncrl_generator_reward_errors", "counter", "reward function errors", "reward_errors"),
]
SPECS = {"learner": LEARNER, "buffer": BUFFER, "generator": GENERATOR}
GENERATOR_STATES = ("starting", "waiting_weights", "generating", "syncing", "draining")
LAG_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32)


def all_metric_names() -> list[str]:
    names = [n for spec in SPECS.values() for n, *_ in spec]
    return names + ["asyncrl_staleness_lag", "asyncrl_buffer_rejected_frames", "asyncrl_generator_state"]


class Exporter:
    """The snapshot one process exports; `update` is cheap and thread-safe."""

    def __init__(self, role: str, labels: dict[str, str] | None = None):
        assert role in SPECS, role
        self.role = role
        self.labels = labels or {}
        self.values: dict[str, float] = {}
        self.rejects: dict[str, float] = {}
        self.state = ""
        self.lag_counts: dict[int, int] = {}  # cumulative tokens per lag, since start
        self._lock = threading.Lock()
        self.url = ""
        self._server = None

    def update(self, values: dict) -> None:
        with self._lock:
            for key, value in values.items():
                if key.startswith("reject:"):
                    self.rejects[key.split(":", 1)[1]] = float(value)
                elif key == "state":
                    self.state = value.decode() if isinstance(value, bytes) else str(value)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.values[key] = float(value)

    def observe_lags(self, lag_hist: dict) -> None:
        with self._lock:
            for lag, count in lag_hist.items():
                self.lag_counts[int(lag)] = self.lag_counts.get(int(lag), 0) + int(count)

    # ---- prometheus_client collector protocol ---------------------------------------------------

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        names, vals = list(self.labels), list(self.labels.values())
        with self._lock:
            values, rejects, state, lags = dict(self.values), dict(self.rejects), self.state, dict(self.lag_counts)
        for name, kind, help_text, key in SPECS[self.role]:
            if key not in values:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_text, labels=names)
            family.add_metric(vals, values[key])
            yield family
        if self.role == "learner":
            cum, buckets = 0, []
            for le in LAG_BUCKETS:
                cum = sum(c for lag, c in lags.items() if lag <= le)
                buckets.append((str(le), cum))
            total = sum(lags.values())
            buckets.append(("+Inf", total))
            family = HistogramMetricFamily("asyncrl_staleness_lag", "version lag of every trained token",
                                           labels=names)
            family.add_metric(vals, buckets, sum_value=float(sum(lag * c for lag, c in lags.items())))
            yield family
        if self.role == "buffer":
            family = CounterMetricFamily("asyncrl_buffer_rejected_frames", "frames rejected, by reason",
                                         labels=[*names, "reason"])
            for reason, count in sorted(rejects.items()):
                family.add_metric([*vals, reason], count)
            yield family
        if self.role == "generator" and state:
            family = GaugeMetricFamily("asyncrl_generator_state", "1 for the state the generator is in",
                                       labels=[*names, "state"])
            for s in sorted(set(GENERATOR_STATES) | {state}):
                family.add_metric([*vals, s], 1.0 if s == state else 0.0)
            yield family

    # ---- serving --------------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> str:
        """Starts the HTTP endpoint; port 0 picks a free one, N tries N..N+63. Returns its URL."""
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        candidates = [0] if port == 0 else range(port, port + 64)
        for p in candidates:
            try:
                self._server, _ = start_http_server(p, addr=host, registry=registry)
                break
            except OSError as e:
                last = e
        else:
            raise OSError(f"logging.prometheus_port: no free port in {port}..{port + 63} on {host}: {last}")
        bound = self._server.server_port
        if port and bound != port:
            log.warning("prometheus port %d taken; serving /metrics on %d instead", port, bound)
        self.url = f"http://{host}:{bound}/metrics"
        log.info("prometheus /metrics for %s at %s", self.role, self.url)
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def exporter_field(role: str, ident: str = "") -> str:
    return f"{role}:{ident}" if ident else role


def start_exporter(cfg: Config, role: str, ident: str = "", client=None, keys=None) -> Exporter | None:
    """Starts `role`'s endpoint when `logging.prometheus` is on; publishes its URL with a sync client."""
    if not cfg.logging.prometheus:
        return None
    exporter = Exporter(role, {"generator": ident} if role == "generator" else {})
    exporter.serve(cfg.logging.prometheus_host, cfg.logging.prometheus_port)
    if client is not None and keys is not None:
        client.hset(keys.exporters, exporter_field(role, ident), exporter.url)
    return exporter
