"""The serving config: one YAML file for the whole cluster (model, engine, replicas, routing,
autoscaling, ports).

Validated pydantic models with a description on every field; unknown keys are rejected with a
message naming them. `kvmesh serve CONFIG` reads it, `build_app(args)` receives it as a dict, and
the Helm chart renders it. Inside the cluster it becomes a frozen `EngineConfig` per worker.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from kvmesh.config import ATTENTION_BACKENDS, DEFAULT_MODEL, KV_CACHE_DTYPES, SCHEDULING_POLICIES, EngineConfig
from kvmesh.router.policies import POLICY_NAMES as ROUTING_POLICIES
from kvmesh.router.policies import policy_defaults, policy_options
AUTOSCALING_POLICIES = ("ongoing_requests", "queue", "kv_pressure", "ttft_slo", "itl_slo")
AGGREGATION_FUNCTIONS = ("mean", "max", "min")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineSection(_Strict):
    """Engine arguments of every worker replica (the same names as `kvmesh.LLM`'s keywords)."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the engine runs: auto (cuda when the replica has a GPU, else cpu), cpu or cuda.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and KV dtype; auto = float32 on the CPU, bfloat16 on a GPU.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block (also the prefix-hash granularity the router sees).")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one engine step (decodes first, then prompt chunks).")
    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once in one worker.")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output in tokens; null = the model's context length.")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="KV pool size in bytes; null = 256 MiB on the CPU, gpu_memory_utilization on a GPU.")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="Fraction of GPU memory the worker may use (weights + KV pool).")
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks of shared prompt prefixes.")
    attention_backend: Literal[ATTENTION_BACKENDS] = Field(  # type: ignore[valid-type]
        "auto", description="Attention kernels: auto, torch, triton, flashinfer or flash_attn.")
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = Field(  # type: ignore[valid-type]
        "auto", description="KV cache element type: auto (the model dtype), or fp8 / fp8_e4m3 (float8 e4m3 with a per-layer K and V scale of 1.0: half the bytes per token of bf16, so twice the blocks; backends torch, triton and flashinfer, not flash_attn).")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs for decode.")
    torch_compile: bool = Field(False, description="torch.compile each layer's work outside attention (fuses residual adds into the norms, q/k norm into rotary); compiles when the worker starts.")
    seed: int = Field(0, ge=0, description="Engine seed (requests without a seed sample from it).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs each worker splits its model over by attention heads (tensor parallelism, one process per GPU, NCCL); the worker is still one replica to the router. Needs replicas.num_gpus equal to it (or 0: CPU processes with gloo, for tests).")
    quantization: Literal["fp8"] | None = Field(None, description="Weight quantization at load: null = weights in dtype; fp8 = the linear layers' weights in FP8 (e4m3, one scale per tensor, activations scaled per token at each step; vLLM's --quantization fp8 with per-token activation scales), half their memory. Needs a GPU of compute capability 8.9+ (Ada, Hopper); not for mixture-of-experts models.")
    scheduling_policy: Literal[SCHEDULING_POLICIES] = Field(  # type: ignore[valid-type]
        "fcfs", description="The order of each worker's engine queue (vLLM's --scheduling-policy): fcfs = by arrival; priority = by each request's `priority` field (lower first; ties by arrival), and when the KV pool runs out the running request of the lowest priority is preempted first. Requests wait in an engine only beyond its max_num_seqs or its KV pool, so set replicas.max_ongoing_requests above max_num_seqs for priorities to order them; the ingress's own queue (max_queued_requests) stays first come, first served. Under fcfs a request with a non-zero priority is refused.")


class ReplicasSection(_Strict):
    """Worker replicas: one Ray actor per replica, each owning `num_gpus` GPUs."""

    num_replicas: int = Field(1, ge=1, description="Worker replicas when autoscaling is off (the initial count when it is on).")
    num_gpus: float = Field(1, ge=0, description="GPUs per worker replica (0 on a CPU-only cluster).")
    num_cpus: float = Field(1, ge=0, description="CPUs reserved per worker replica.")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests a replica accepts at once; the router spills over to the next replica beyond it.")
    max_queued_requests: int = Field(1024, ge=-1, description="Requests an ingress may hold waiting for a free worker slot; beyond it new requests get 429 with Retry-After (-1 = no limit).")
    engine_process: bool = Field(True, description="Run the engine in a child process of the worker replica, so that a model step never waits for Python's GIL held by the replica's event loop while it streams tokens (false: on a thread of the replica).")
    resources: dict[str, float] = Field(default_factory=dict, description="Ray custom resources per worker replica (e.g. {accelerator_type:H200: 0.001}).")
    engine_stall_timeout_s: float = Field(3.0, gt=0, description="A worker whose engine has requests but finishes no step for this long is reported stalled: routers rank it after every other worker (new requests go elsewhere) until it steps again.")


class RoutingSection(_Strict):
    """How the request router picks a worker replica for each request."""

    policy: Literal[ROUTING_POLICIES] = Field(  # type: ignore[valid-type]
        "kv_events", description="kv_events (exact KV-event prefix index + load), round_robin, least_loaded, power_of_two, session, prefix_approx.")
    ingress_replicas: int = Field(1, ge=1, description="Ingress (HTTP/gRPC front end) replicas; each holds its own router copy fed by the same KV event stream.")
    temperature: float = Field(0.0, ge=0, description="kv_events: softmax temperature over costs (0 = always the cheapest worker).")
    policy_options: dict[str, Any] = Field(default_factory=dict, description="The policy's own options, by name (docs/ROUTING.md \"Policies\"): kv_events takes weights (a mapping of the cost weights, e.g. {stay_margin: 4096}) and pending_requests; prefix_approx max_blocks_per_worker, cache_threshold, balance_abs, balance_rel; session virtual_nodes; an option the policy does not take is refused by name.")
    session_header: str = Field("x-session-id", description="session policy: HTTP header that keys a session (else OpenAI's `prompt_cache_key`, else `user`).")
    event_poll_timeout_s: float = Field(1.0, gt=0, description="Longest wait of one router copy's long poll for KV events.")
    load_report_interval_s: float = Field(0.05, gt=0, le=1.0, description="How often a busy worker reports its load to the routers (at most 1 s: an idle worker reports every second, and a router ranks a worker whose reports stop changing for 3 s last).")

    @field_validator("policy_options")
    @classmethod
    def _options_of_the_policy(cls, options: dict, info: ValidationInfo) -> dict:
        from kvmesh.router.router import Router

        policy = info.data.get("policy")
        if policy is None:  # the policy itself was refused
            return options
        if "temperature" in options:
            raise ValueError("temperature: set routing.temperature instead")
        # the policy built once with them: its own checks of their values run here too
        Router(policy=policy, **policy_options(policy, options))
        return options

    @field_validator("temperature")
    @classmethod
    def _temperature_of_the_policy(cls, temperature: float, info: ValidationInfo) -> float:
        policy = info.data.get("policy")
        if temperature and policy is not None and "temperature" not in policy_defaults(policy):
            raise ValueError(f"policy {policy!r} takes no temperature (kv_events does)")
        return temperature


class AutoscalingSection(_Strict):
    """Worker autoscaling through Serve with a kvmesh policy (see docs/SERVING.md)."""

    enabled: bool = Field(False, description="Scale worker replicas by `policy`; off = a fixed replicas.num_replicas.")
    policy: Literal[AUTOSCALING_POLICIES] = Field(  # type: ignore[valid-type]
        "ongoing_requests", description="ongoing_requests (Serve's request count per replica), queue (running + waiting in the engines + queued at the ingress, per replica), kv_pressure (KV the requests need vs a free-KV threshold), ttft_slo (p90 TTFT from ingress arrival vs a target) or itl_slo (p90 inter-token latency vs a target); each asks for the replicas it needs in one step.")
    min_replicas: int = Field(1, ge=0, description="Fewest worker replicas; 0 = scale to zero when idle (requests arriving then wait at the ingress while a replica starts).")
    max_replicas: int = Field(4, ge=1, description="Most worker replicas.")
    upscale_delay_s: float = Field(5, ge=0, description="How long a scale-up decision must hold before Serve adds replicas.")
    downscale_delay_s: float = Field(30, ge=0, description="How long a scale-down decision must hold before Serve removes replicas.")
    downscale_to_zero_delay_s: float | None = Field(None, ge=0, description="How long a decision to go from 1 replica to 0 must hold (min_replicas 0); null = downscale_delay_s.")
    upscaling_factor: float = Field(1.0, gt=0, le=10, description="Serve's gain on a scale-up: replicas added = factor x (desired - current), rounded up (below 1 damps, above 1 overshoots).")
    downscaling_factor: float = Field(1.0, gt=0, le=1, description="Serve's gain on a scale-down: replicas removed = factor x (current - desired), at least one.")
    aggregation_function: Literal[AGGREGATION_FUNCTIONS] = Field(  # type: ignore[valid-type]
        "mean", description="How Serve aggregates each replica's metrics over window_s: mean, max or min.")
    target_ongoing_requests: float = Field(8, gt=0, description="ongoing_requests and queue: requests per replica to aim for; kv_pressure and the SLO policies scale down only to replicas that keep this.")
    kv_free_threshold: float = Field(0.1, ge=0, lt=1, description="kv_pressure: the free-KV fraction to keep; scale up when the KV the requests need leaves less.")
    ttft_p90_target_s: float = Field(1.0, gt=0, description="ttft_slo: target p90 time to first token in seconds, from arrival at the ingress.")
    itl_p90_target_s: float = Field(0.1, gt=0, description="itl_slo: target p90 inter-token latency in seconds (a request's mean time per output token after the first).")
    window_s: float = Field(30, gt=0, description="Look-back window of the metrics the policies read (and of the workers' latency percentiles).")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.min_replicas ({self.min_replicas}) must be <= "
                             f"autoscaling.max_replicas ({self.max_replicas})")
        return self


class ServerSection(_Strict):
    """Listening addresses of Serve's HTTP and gRPC proxies."""

    host: str = Field("127.0.0.1", description="HTTP bind address (0.0.0.0 to accept remote clients).")
    stream_interval: int = Field(1, ge=1, le=1024, description="Tokens per streamed chunk after the first token, which always goes out at once (1 = every step's tokens as they come; larger values send fewer, bigger chunks through Serve, as vLLM's and SGLang's --stream-interval).")
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    grpc_port: int = Field(9000, ge=0, le=65535, description="gRPC port (kvmesh.v1.Generation); 0 disables gRPC.")
    direct_http_port: int = Field(0, ge=0, le=65535, description="Also serve the OpenAI API from each ingress replica's own HTTP server on this port (shared by the replicas of a node), skipping Serve's HTTP proxy; 0 = off.")
    api_keys: list[str] = Field(default_factory=list, description="Accepted bearer tokens; empty = no authentication (the KVMESH_API_KEYS environment variable of the ingress adds more, e.g. from a Kubernetes Secret).")
    auth_health: bool = Field(False, description="With API keys set, /health and gRPC Health need a key too (off: open to load balancers).")
    auth_metrics: bool = Field(False, description="With API keys set, /metrics needs a key too (off: open to Prometheus).")
    special_tokens_in_content: bool = Field(False, description="Tokenize special-token strings inside chat message content as control tokens (off: as text, so a user cannot forge a system turn with <|im_start|>system).")
    trust_request_chat_template: bool = Field(False, description="Accept a chat request's own Jinja `chat_template` (vLLM's --trust-request-chat-template); off, such a request is a 400 naming the field: a template is code the server runs on every request that sends it.")
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(None, description="Split a reasoning model's thinking block (<think> ... </think>) out of chat answers into the message's `reasoning` field (vLLM's --reasoning-parser): qwen3 (Qwen3, an output opening with <think>) or deepseek_r1 (DeepSeek-R1, QwQ: the output starts inside the block). Structured outputs then constrain what follows </think>. The model's tokenizer must have both markers as single tokens (checked at start). None: answers as generated.")
    structured_outputs_in_reasoning: bool = Field(False, description="With a reasoning_parser: structured outputs constrain the whole output, thinking block included (vLLM's enable_in_reasoning); off: only what follows </think>.")
    api_docs: bool = Field(False, description="Serve the API's OpenAPI schema and docs pages (/openapi.json, /docs), behind the API key when keys are set.")
    stream_idle_timeout_s: float = Field(30.0, ge=0, description="A streaming response whose client has read nothing for this long has its request aborted on the worker, freeing its KV blocks, and (HTTP) its connection reset; gRPC: once one message has waited this long to be written (docs/RELIABILITY.md). Serve's HTTP and gRPC proxies (kvmesh's worker hook: a local `kvmesh serve`, `--address`, and the nodes of deploy/ and the Helm chart) and direct_http_port. 0 = never.")
    max_header_bytes: int = Field(65_536, ge=1024, le=16_777_216, description="Largest HTTP request head (request line + headers) in bytes on Serve's HTTP proxy and the direct port; beyond it 431 and the connection is closed, before the rest is read.")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, description="Seconds a client has to send a complete HTTP request head (from connecting, or from the first byte of its next request); beyond it 408 and the connection is closed.")
    keep_alive_timeout_s: int = Field(90, ge=1, le=3600, description="Seconds an idle kept-alive HTTP connection stays open between requests (Serve's proxy and the direct port); keep it above a load balancer's idle timeout.")
    grpc_max_message_bytes: int = Field(4_194_304, ge=1024, le=2_147_483_647, description="Largest gRPC request message in bytes on Serve's gRPC proxy; beyond it the call fails with RESOURCE_EXHAUSTED before it reaches the ingress.")
    grpc_reflection: bool = Field(False, description="Serve gRPC server reflection on the gRPC proxy (it answers without an API key).")
    responses_store: int = Field(0, ge=0, le=1_000_000, description="Keep up to this many /v1/responses responses asked for with store: true, in memory in one Ray actor shared by the ingress replicas, for GET and DELETE /v1/responses/{id} and previous_response_id (the least recently stored or read dropped first; each visible only to the API key that stored it); 0 = off: store: true and previous_response_id are refused.")

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        # An empty key (`--api-key "$UNSET"`) would otherwise leave the server open without a word.
        for i, key in enumerate(keys):
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"api_keys[{i}] is {'empty' if not key else 'a key with whitespace'}: "
                                 f"a key must be non-empty and hold no whitespace (no keys at all = "
                                 f"no authentication)")
        return keys


class LimitsSection(_Strict):
    """Per-request limits the ingress enforces before a request reaches a worker (see cluster/limits.py)."""

    max_prompt_tokens: int | None = Field(None, ge=1, description="Longest prompt in tokens; null = the model's max_model_len minus 1.")
    max_output_tokens: int | None = Field(None, ge=1, description="Largest max_tokens a request may ask for, and the default when it asks for none; null = the context left after the prompt.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest HTTP request body in bytes; beyond it 413.")
    max_prompt_chars: int | None = Field(None, ge=1, description="Longest prompt in characters (all message contents of a chat), refused with 400 before it is tokenized; null = 32 x limits.max_prompt_tokens when set, else 32 x the model's max_model_len.")


class ServeConfig(_Strict):
    """The whole serving config (see deploy/serve.yaml for a documented example)."""

    model: str = Field(DEFAULT_MODEL, min_length=1, description="Model: a name (smollm2-135m-instruct), a Hugging Face directory, or random:<preset>.")
    engine: EngineSection = Field(default_factory=EngineSection, description="Engine arguments of every worker.")
    replicas: ReplicasSection = Field(default_factory=ReplicasSection, description="Worker replicas and their resources.")
    routing: RoutingSection = Field(default_factory=RoutingSection, description="Request routing policy.")
    autoscaling: AutoscalingSection = Field(default_factory=AutoscalingSection, description="Worker autoscaling.")
    server: ServerSection = Field(default_factory=ServerSection, description="HTTP / gRPC listeners.")
    limits: LimitsSection = Field(default_factory=LimitsSection, description="Per-request limits (prompt, output, body size).")
    app_name: str = Field("kvmesh", min_length=1, description="Serve application name (also names the KV event hub actor).")
    route_prefix: str = Field("/", description="HTTP route prefix of the application.")

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("route_prefix must start with '/'")
        return v

    @model_validator(mode="after")
    def _gpus_for_ranks(self):
        tp, gpus = self.engine.tensor_parallel_size, self.replicas.num_gpus
        if tp > 1 and gpus not in (0, tp):
            raise ValueError(f"replicas.num_gpus ({gpus:g}) must equal engine.tensor_parallel_size ({tp}): "
                             f"each rank of a worker runs on its own GPU (or 0 for CPU ranks)")
        return self

    @property
    def scales_to_zero(self) -> bool:
        """Autoscaling may take the workers to zero replicas (then none is not a failure)."""
        return self.autoscaling.enabled and self.autoscaling.min_replicas == 0

    def engine_config(self, worker_id: str, device: str | None = None) -> EngineConfig:
        """The frozen engine arguments of one worker replica."""
        e = self.engine
        return EngineConfig(
            model=self.model, device=device or e.device, dtype=e.dtype, block_size=e.block_size,
            max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
            max_model_len=e.max_model_len, kv_cache_memory_bytes=e.kv_cache_memory_bytes,
            gpu_memory_utilization=e.gpu_memory_utilization,
            enable_prefix_caching=e.enable_prefix_caching, attention_backend=e.attention_backend,
            kv_cache_dtype=e.kv_cache_dtype, enforce_eager=e.enforce_eager, torch_compile=e.torch_compile,
            seed=e.seed, worker_id=worker_id, tensor_parallel_size=e.tensor_parallel_size,
            quantization=e.quantization, scheduling_policy=e.scheduling_policy)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_config(data: dict[str, Any] | None) -> ServeConfig:
    """Validate a config dict; errors name each bad field by its dotted path."""
    try:
        return ServeConfig.model_validate(data or {})
    except ValidationError as e:
        raise ValueError(format_errors(e)) from None


def load_config(path: str | None) -> ServeConfig:
    """Read a YAML serving config (None: all defaults)."""
    if path is None:
        return ServeConfig()
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such config file" + (" (a directory)" if os.path.isdir(path) else ""))
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:  # one line with where, not the parser's traceback
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"{path}: not valid YAML{where}: {what}") from None
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a YAML mapping, got {type(data).__name__}")
    try:
        return parse_config(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def format_errors(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key {where!r}")
        else:  # a validator's own ValueError without pydantic's "Value error, " in front
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{where}: {msg}")
    return "invalid serving config: " + "; ".join(parts)


def describe_fields(model: type[BaseModel] = ServeConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, description) of every field, for docs and the every-field-documented test."""
    out = []
    for name, info in model.model_fields.items():
        out.append((prefix + name, info.description or ""))
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(describe_fields(ann, prefix + name + "."))
    return out
