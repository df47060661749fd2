"""Prometheus metrics, named in vLLM's style under the ``teacher_server_`` prefix, and
optionally also under vLLM's own ``vllm:`` names (the ones vLLM dashboards and autoscalers
read). Each app has its own registry (several apps can live in one process, as in tests)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

# No `<name>_created` series: they double the series count and dashboards do not read them.
disable_created_metrics()

STAGES = ("schedule", "prepare", "launch", "wait", "scatter")
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    """The service's metrics; ``labels(metric, **kw)`` fills in the model name."""

    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, "teacher_server_"
        lab = ["model_name"]
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued, not yet scheduled.", lab, registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests part-way through prefill.", lab, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", lab, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.", lab, registry=r)
        self.computed_tokens = Counter(p + "computed_tokens", "Tokens run through the model (excludes cache hits).",
                                       lab, registry=r)
        self.scored_rows = Counter(p + "scored_rows", "Scored rows (result matrix rows) returned.", lab, registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Cacheable prompt tokens looked up.", lab, registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens served from the prefix cache.", lab,
                                   registry=r)
        self.requests = Counter(p + "requests", "Finished HTTP scoring requests by status code.",
                                lab + ["status"], registry=r)
        self.failures = Counter(p + "request_failures", "Failed requests by reason.", lab + ["reason"], registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to response.", lab, buckets=_LAT, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Arrival to first scheduled step.", lab,
                                    buckets=_LAT, registry=r)
        self.inference_time = Histogram(p + "request_inference_time_seconds", "First scheduled step to finish.",
                                        lab, buckets=_LAT, registry=r)
        self.steps = Counter(p + "engine_steps", "Forward steps run.", lab, registry=r)
        self.stage_seconds = Counter(p + "engine_stage_seconds",
                                     "Engine-thread time per step stage: schedule, prepare, launch (queueing GPU "
                                     "work), wait (for the GPU), scatter (results to requests).",
                                     lab + ["stage"], registry=r)
        self.gpu_seconds = Counter(p + "engine_gpu_seconds",
                                   "GPU time seen by the engine (CUDA events): idle, when the GPU had run out of "
                                   "queued work while the engine was still launching (inside a step or between "
                                   "two back-to-back steps: the host was late); busy, the rest of each step from "
                                   "its first kernel to its results on the host.", lab + ["kind"], registry=r)
        self.healthy = Gauge(p + "healthy", "1 when the engine can serve.", lab, registry=r)
        self.model_name = model_name
        for m in (self.waiting, self.running, self.kv_usage, self.prompt_tokens, self.computed_tokens,
                  self.scored_rows, self.prefix_queries, self.prefix_hits, self.e2e, self.queue_time,
                  self.inference_time, self.steps, self.healthy):
            m.labels(model_name=model_name)  # export every series from the start
        for stage in STAGES:
            self.stage_seconds.labels(model_name=model_name, stage=stage)
        for kind in ("busy", "idle"):
            self.gpu_seconds.labels(model_name=model_name, kind=kind)
        if vllm_names:
            r.register(VllmNames([
                (self.waiting, "vllm:num_requests_waiting"), (self.running, "vllm:num_requests_running"),
                (self.kv_usage, "vllm:kv_cache_usage_perc"), (self.kv_usage, "vllm:gpu_cache_usage_perc"),
                (self.prompt_tokens, "vllm:prompt_tokens"), (self.e2e, "vllm:e2e_request_latency_seconds"),
                (self.queue_time, "vllm:request_queue_time_seconds"),
                (self.inference_time, "vllm:request_inference_time_seconds"),
                (self.prefix_queries, "vllm:prefix_cache_queries"), (self.prefix_hits, "vllm:prefix_cache_hits")]))

    def labels(self, metric: MetricWrapperBase, **kw: str) -> MetricWrapperBase:
        return metric.labels(model_name=self.model_name, **kw)


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
