"""Prometheus metrics, named in vLLM's style under the ``teacher_server_`` prefix, and
optionally also under vLLM's own ``vllm:`` names (the ones vLLM dashboards and autoscalers
read). Each app has its own registry (several apps can live in one process, as in tests)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from teacher_server.engine.stats import EngineStats
from teacher_server.server.admission import QueueWait
from teacher_server.server.byte_budget import ByteBudget

# No `<name>_created` series: they double the series count and dashboards do not read them.
disable_created_metrics()

STAGES = ("schedule", "prepare", "launch", "wait", "scatter")
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    """The service's metrics; ``labels(metric, **kw)`` fills in the model name. With several
    replicas (``replicas > 1``) the engine's own metrics (queues, KV, steps, prefix cache,
    health) carry a ``replica`` label too ("0", "1", ...); ``engine_labels`` fills it in."""

    def __init__(self, model_name: str, vllm_names: bool = False, replicas: int = 1,
                 replica_label: bool | None = None) -> None:
        """``replica_label``: whether engine metrics carry ``replica`` (default: with several
        replicas; several teachers share one registry, so it is on for all when one has several)."""
        self.registry = CollectorRegistry()
        r, p = self.registry, "teacher_server_"
        lab = ["model_name"]
        self.replica_label = replicas > 1 if replica_label is None else replica_label
        eng = lab + (["replica"] if self.replica_label else [])  # per engine: per replica when there are several
        self.replicas = replicas
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued, not yet scheduled.", eng, registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests part-way through prefill.", eng, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", eng, registry=r)
        self.state_used = Gauge(p + "linear_state_slots_used", "Linear-attention state slots in use (hybrid models; "
                                "working slots and snapshots).", eng, registry=r)
        self.state_snapshots = Gauge(p + "linear_state_snapshots", "Prompt state snapshots kept for prefix reuse "
                                     "(hybrid models).", eng, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", lab, registry=r)
        self.computed_tokens = Counter(p + "computed_tokens", "Tokens run through the model (excludes cache hits).",
                                       eng, registry=r)
        self.scored_rows = Counter(p + "scored_rows", "Scored rows (result matrix rows) returned.", lab, registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Cacheable prompt tokens looked up.", eng, registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens served from the prefix cache.", eng,
                                   registry=r)
        self.requests = Counter(p + "requests", "Finished HTTP scoring requests by status code.",
                                lab + ["status"], registry=r)
        self.failures = Counter(p + "request_failures", "Failed requests by reason.", lab + ["reason"], registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to response.", lab, buckets=_LAT, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Arrival to first scheduled step.", lab,
                                    buckets=_LAT, registry=r)
        self.inference_time = Histogram(p + "request_inference_time_seconds", "First scheduled step to finish.",
                                        lab, buckets=_LAT, registry=r)
        self.steps = Counter(p + "engine_steps", "Forward steps run.", eng, registry=r)
        self.stage_seconds = Counter(p + "engine_stage_seconds",
                                     "Engine-thread time per step stage: schedule, prepare, launch (queueing GPU "
                                     "work), wait (for the GPU), scatter (results to requests).",
                                     eng + ["stage"], registry=r)
        self.gpu_seconds = Counter(p + "engine_gpu_seconds",
                                   "GPU time seen by the engine (CUDA events): idle, when the GPU had run out of "
                                   "queued work while the engine was still launching (inside a step or between "
                                   "two back-to-back steps: the host was late); busy, the rest of each step from "
                                   "its first kernel to its results on the host.", eng + ["kind"], registry=r)
        self.healthy = Gauge(p + "healthy", "1 when the engine can serve.", eng, registry=r)
        self.token_budget = Gauge(p + "token_budget", "Tokens one forward step holds (max_num_batched_tokens as "
                                  "configured, or as chosen from the GPU's memory).", eng, registry=r)
        self.kernel_on = Gauge(p + "kernel_enabled", "1 where the engine runs this kernel of ours: on after its "
                               "start-up check (and, for the picked ones, its timing against the torch path).",
                               eng + ["kernel"], registry=r)
        self.kv_tokens = Gauge(p + "kv_cache_tokens", "Tokens the KV pool holds (each tensor-parallel rank holds its "
                               "share of the heads of all of them).", eng, registry=r)
        self.inflight_bytes = Gauge(p + "inflight_bytes", "Bytes the requests in flight hold against "
                                    "max_inflight_bytes (bodies being read, arrays, results until sent).", lab,
                                    registry=r)
        self.queue_wait = Gauge(p + "estimated_queue_wait_seconds", "Tokens queued at the front over the measured "
                                "throughput: the wait a new request of priority 0 would have (0 before a "
                                "measurement).", lab, registry=r)
        self.restarts = Counter(p + "engine_restarts", "Times the engine (a replica, or the engine in a process of "
                                "its own) was restarted after it died, hung or stalled.", eng, registry=r)
        self.model_name = model_name
        self._export()
        if vllm_names:
            r.register(VllmNames([
                (self.waiting, "vllm:num_requests_waiting"), (self.running, "vllm:num_requests_running"),
                (self.kv_usage, "vllm:kv_cache_usage_perc"), (self.kv_usage, "vllm:gpu_cache_usage_perc"),
                (self.prompt_tokens, "vllm:prompt_tokens"), (self.e2e, "vllm:e2e_request_latency_seconds"),
                (self.queue_time, "vllm:request_queue_time_seconds"),
                (self.inference_time, "vllm:request_inference_time_seconds"),
                (self.prefix_queries, "vllm:prefix_cache_queries"), (self.prefix_hits, "vllm:prefix_cache_hits")]))

    def for_model(self, model_name: str, replicas: int) -> Metrics:
        """The same metrics (one registry) for another teacher's series: its ``model_name`` and
        ``replicas``; its engines' totals tracked on their own."""
        view = copy.copy(self)
        view.model_name, view.replicas = model_name, replicas
        assert replicas == 1 or self.replica_label, "a teacher with several replicas needs the replica label"
        view._export(front=False)
        return view

    def _export(self, front: bool = True) -> None:
        """Every series from the start; the bytes in flight are the service's: the first teacher's
        (``front``) alone."""
        model_name, replicas = self.model_name, self.replicas
        self._last: dict[int | None, list[float]] = {}  # per replica: the engine totals last seen
        for m in (self.prompt_tokens, self.scored_rows, self.e2e, self.queue_time, self.inference_time,
                  self.queue_wait, *([self.inflight_bytes] if front else [])):
            m.labels(model_name=model_name)
        for rep in ([None] if replicas == 1 else range(replicas)):
            for m in (self.waiting, self.running, self.kv_usage, self.state_used, self.state_snapshots,
                      self.computed_tokens, self.prefix_queries, self.prefix_hits, self.steps, self.healthy,
                      self.token_budget, self.kv_tokens, self.restarts):
                self.engine_labels(m, rep)
            for stage in STAGES:
                self.engine_labels(self.stage_seconds, rep, stage=stage)
            for kind in ("busy", "idle"):
                self.engine_labels(self.gpu_seconds, rep, kind=kind)

    def labels(self, metric: MetricWrapperBase, **kw: str) -> MetricWrapperBase:
        return metric.labels(model_name=self.model_name, **kw)

    def engine_labels(self, metric: MetricWrapperBase, replica: int | None, **kw: str) -> MetricWrapperBase:
        """An engine metric's series: of replica ``replica`` when there are several (None: the one engine)."""
        if self.replicas > 1:
            assert replica is not None, "a replica index is needed with several replicas"
        if self.replica_label:
            kw["replica"] = str(replica or 0)
        return self.labels(metric, **kw)

    def set_healthy(self, ok: bool, replica: int | None = None) -> None:
        """Health of the engine, or of one replica; None with several replicas: all of them."""
        for rep in ([replica] if replica is not None or self.replicas == 1 else range(self.replicas)):
            self.engine_labels(self.healthy, rep).set(1 if ok else 0)
            if not ok:  # a dead engine holds nothing (its last snapshot's work went elsewhere), and its
                for g in (self.waiting, self.running, self.kv_usage, self.state_used, self.state_snapshots):
                    self.engine_labels(g, rep).set(0)
                if self.replicas == 1:  # successor's totals start again from 0: counted whole
                    self._last.clear()
                else:
                    self._last.pop(rep, None)

    def observe_front(self, budget: ByteBudget, queue: QueueWait) -> None:
        """The front's own gauges: bytes in flight and the estimated wait."""
        self.labels(self.inflight_bytes).set(budget.used)
        self.labels(self.queue_wait).set(queue.estimated_wait_s)

    def observe_engine(self, s: EngineStats, replica: int | None = None) -> None:
        """Feed an engine's snapshot: counters grow by what its running totals grew since the
        last snapshot of the same engine; gauges take its current values."""
        t = s.timing
        lab = lambda m, **kw: self.engine_labels(m, replica, **kw)  # noqa: E731
        now = [(lab(self.stage_seconds, stage=stage), v) for stage, v in t.stages().items()] + [
            (lab(self.gpu_seconds, kind="busy"), t.gpu_s), (lab(self.gpu_seconds, kind="idle"), t.gpu_idle_s),
            (lab(self.computed_tokens), s.computed_tokens), (lab(self.prefix_queries), s.prefix_query_tokens),
            (lab(self.prefix_hits), s.prefix_hit_tokens), (lab(self.steps), s.steps)]
        last = self._last.get(replica)
        for i, (counter, total) in enumerate(now):
            d = total - (last[i] if last else 0)
            if d > 0:
                counter.inc(d)
        self._last[replica] = [v for _, v in now]
        self.observe_gauges(s, replica)

    def observe_gauges(self, s: EngineStats, replica: int | None = None) -> None:
        self.engine_labels(self.waiting, replica).set(s.waiting)
        self.engine_labels(self.running, replica).set(s.running)
        self.engine_labels(self.kv_usage, replica).set(s.kv_usage)
        self.engine_labels(self.state_used, replica).set(s.state_slots_used)
        self.engine_labels(self.state_snapshots, replica).set(s.state_snapshots)
        self.engine_labels(self.token_budget, replica).set(s.token_budget)
        self.engine_labels(self.kv_tokens, replica).set(s.kv_tokens_total)
        for kernel, on in s.kernels:
            self.engine_labels(self.kernel_on, replica, kernel=kernel).set(1 if on else 0)


class VllmNames:
    """A collector that re-exports metrics under other names at scrape time (one source of
    truth: nothing is counted twice)."""

    def __init__(self, aliases: list[tuple[MetricWrapperBase, str]]) -> None:
        self.aliases = aliases

    def collect(self) -> Iterator[Metric]:
        for metric, alias in self.aliases:
            for family in metric.collect():
                out = Metric(alias, family.documentation, family.type, family.unit)
                # samples are the family name plus a suffix (_total, _bucket, _sum, _count)
                out.samples = [s._replace(name=alias + s.name[len(family.name):]) for s in family.samples]
                yield out
