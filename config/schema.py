"""Typed, frozen configuration: one Struct per YAML section, a default for every key.

`config/default.yaml` documents every key; a test keeps the two in step.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal, Optional, Union

import msgspec

from config.geometry import MODEL_ID_PATTERN


PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
ModelId = Annotated[str, msgspec.Meta(pattern=MODEL_ID_PATTERN)]
Quality = Annotated[int, msgspec.Meta(ge=1, le=100)]
Endpoint = Annotated[str, msgspec.Meta(pattern=r"^(tcp|ipc|inproc)://.+\Z")]
FrameOrder = Literal["mirror", "loop"]
OutputFormat = Literal["jpeg", "png", "raw"]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class TenantConfig(_Section):
    keys: tuple[str, ...]                # public key files (from `python -m supervisor keys`)
    models: tuple[str, ...] = ("*",)     # model ids this tenant may use; "*" = all
    # live sessions this tenant's clients may hold open on this host at once (session_open past it:
    # busy); None: only sessions.max_sessions, the host's
    max_sessions: Optional[PosInt] = None


class CurveConfig(_Section):
    secret_key: str                      # this server's secret key file
    tenants: dict[str, TenantConfig] = {}


class FrontendConfig(_Section):
    bind: tuple[Endpoint, ...] = ("tcp://127.0.0.1:5555",)
    routing: Literal["affinity", "least_loaded", "round_robin"] = "affinity"
    curve: Optional[CurveConfig] = None
    processes: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1   # client-facing processes sharing the binds

    def session_limits(self) -> dict[str, int]:
        """The tenants with a live-session limit of their own (curve.tenants.NAME.max_sessions), by name
        (sorted: the order of their columns on the sessions board, shm/board.py)."""
        tenants = self.curve.tenants if self.curve is not None else {}
        return {name: t.max_sessions for name, t in sorted(tenants.items()) if t.max_sessions is not None}


class BridgeHost(_Section):
    endpoint: Optional[Endpoint] = None  # the GPU host's bridge.bind, as this edge reaches it
    dns: Optional[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,253}\Z")]] = None   # or: a name
    port: Port = 5570                    # dns: the GPU hosts' bridge port
    max_hosts: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8   # dns: at most this many hosts behind the name
    server_key: Optional[str] = None     # that host's public key file (required unless insecure_plaintext)


class BridgeConfig(_Section):
    bind: Endpoint = "tcp://127.0.0.1:5570"        # role gpu: where edges connect
    secret_key: Optional[str] = None               # role gpu: this host's secret key file
    authorized_keys: Optional[str] = None          # role gpu: directory of edge public key files
    hosts: tuple[BridgeHost, ...] = ()             # roles all/edge: GPU hosts to use
    client_secret_key: Optional[str] = None        # roles all/edge: this edge's secret key file
    insecure_plaintext: bool = False               # allow a bridge without keys (trusted networks only)
    heartbeat_s: PosFloat = 0.25
    dead_after_s: PosFloat = 3.0
    resolve_s: PosFloat = 5.0                      # roles all/edge: how often DNS names in hosts are resolved
    processes: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1   # role gpu: bridge processes sharing bind


class MetricsConfig(_Section):
    port: Port = 9108
    host: str = "127.0.0.1"

    def port_of(self, index: int) -> int:
        """The port client-facing process `index` (frontend.processes, bridge.processes) serves: port + index;
        0: none."""
        return self.port + index if self.port else 0


class ModelEntry(_Section):
    onnx: str
    frames: str
    crop_rects: str
    frame_order: FrameOrder = "mirror"
    audio_encoder: Optional[str] = None    # this model's mel -> features encoder (else audio.encoder)


class LimitsConfig(_Section):
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=256)] = 32
    queue_depth: PosInt = 64
    request_timeout_s: PosFloat = 30.0
    max_audio_elements: PosInt = 256 * 16 * 32
    max_message_bytes: PosInt = 512 * 1024 * 1024
    max_header_bytes: Annotated[int, msgspec.Meta(ge=256)] = 64 * 1024
    max_client_backlog_bytes: PosInt = 256 * 1024 * 1024
    max_backlog_bytes: PosInt = 1024 * 1024 * 1024


class InferenceConfig(_Section):
    devices: Union[Literal["auto", "cpu"], tuple[NonNegInt, ...]] = "auto"
    workers_per_device: PosInt = 1
    max_models_per_worker: PosInt = 16
    max_model_bytes: NonNegInt = 0
    eviction: Literal["lru", "lfu"] = "lru"
    idle_unload_s: NonNegFloat = 0.0
    preload: tuple[ModelId, ...] = ()
    intra_op_threads: NonNegInt = 0
    spin_threads: bool = False
    precision: Literal["fp32", "fp16"] = "fp32"
    cuda_graphs: bool = False
    mixed_steps: Literal["auto", "grouped", "sub_calls"] = "sub_calls"


class CompositingConfig(_Section):
    workers: Union[Literal["auto"], PosInt] = "auto"
    cache_bytes: Annotated[int, msgspec.Meta(ge=16 * 1024 * 1024)] = 2 * 1024**3
    preload: tuple[ModelId, ...] = ()
    max_frame_width: Annotated[int, msgspec.Meta(ge=64, le=8192)] = 1920
    max_frame_height: Annotated[int, msgspec.Meta(ge=64, le=8192)] = 1080
    eviction: Literal["lru", "lfu"] = "lru"
    jpeg_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 128 * 1024 * 1024

    def resolved_workers(self) -> int:
        if self.workers == "auto":
            return max(1, (os.cpu_count() or 2) - 1)
        return self.workers


class OutputConfig(_Section):
    format: OutputFormat = "jpeg"
    quality: Quality = 75


class ShmConfig(_Section):
    slots: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    prefix: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9]{0,11}\Z")] = "lsync"


class SupervisorConfig(_Section):
    start_timeout_s: PosFloat = 120.0
    shutdown_timeout_s: PosFloat = 10.0
    restart_backoff_s: NonNegFloat = 0.5
    max_restarts: NonNegInt = 10
    restart_window_s: PosFloat = 300.0


class AudioConfig(_Section):
    encoder: Optional[str] = None          # the ave audio encoder shared by models without their own


class H264Config(_Section):
    bitrate: Annotated[int, msgspec.Meta(ge=50_000, le=50_000_000)] = 600_000
    preset: Literal["ultrafast", "superfast", "veryfast", "faster", "fast", "medium"] = "ultrafast"
    gop: Annotated[int, msgspec.Meta(ge=1, le=600)] = 50
    idle_loop: bool = True
    loop_chunk: Annotated[int, msgspec.Meta(ge=1, le=600)] = 10


class SessionsConfig(_Section):
    fps: Annotated[float, msgspec.Meta(ge=1, le=60)] = 25.0
    max_sessions: PosInt = 256
    max_cpu_load: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.75      # 0: no admission by load
    max_process_load: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    speaking_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5   # admission: what share of time sessions speak
    burst_share: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.01     # admission: bursts passed this share of time
    max_burst_load: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9    # ... must fit this share of the cores
    shed_speech: bool = True                                            # newest session first, when full
    latency_budget_ms: Annotated[int, msgspec.Meta(ge=40, le=10000)] = 280
    max_chunk_frames: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 50
    max_ahead_s: PosFloat = 30.0
    max_queued_frames: PosInt = 50
    idle_cache_bytes: Annotated[int, msgspec.Meta(ge=1024 * 1024)] = 256 * 1024 * 1024
    start_delay_ms: Annotated[int, msgspec.Meta(ge=0, le=5000)] = 200
    h264: H264Config = H264Config()


class IceServer(_Section):
    urls: tuple[str, ...]
    username: Optional[str] = None
    credential: Optional[str] = None


class ViewerConfig(_Section):
    port: Port = 8080
    host: str = "127.0.0.1"
    public_url: Optional[str] = None
    ice_servers: tuple[IceServer, ...] = ()


class DemoConfig(_Section):
    cache_dir: str = "~/.cache/lipsync-serve"
    frames: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 250
    seed: int = 0


class Config(_Section):
    frontend: FrontendConfig = FrontendConfig()
    metrics: MetricsConfig = MetricsConfig()
    models_dir: Union[str, None] = None
    # id -> a directory in the models_dir layout, or explicit file paths
    models: dict[ModelId, Union[str, ModelEntry]] = {}
    limits: LimitsConfig = LimitsConfig()
    inference: InferenceConfig = InferenceConfig()
    compositing: CompositingConfig = CompositingConfig()
    output: OutputConfig = OutputConfig()
    shm: ShmConfig = ShmConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    sessions: SessionsConfig = SessionsConfig()
    audio: AudioConfig = AudioConfig()
    demo: DemoConfig = DemoConfig()
    bridge: BridgeConfig = BridgeConfig()
    viewer: ViewerConfig = ViewerConfig()
    # Where the file came from: relative paths in it resolve against this directory.
    base_dir: str = "."
