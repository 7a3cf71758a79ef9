"""Every HTTP-server setting, declared once, as ``engine.args`` declares the engine's.

``kvserve serve`` derives its http and limits flags from ``ServerArgs``; ``build_app`` takes one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.args import setting

HTTP = "http"
LIMITS = "limits and security"
MIB = 1 << 20
# The environment variable read for API keys when no --api-key is given (as VLLM_API_KEY).
API_KEY_ENV = "KVSERVE_API_KEY"


@dataclass(frozen=True)
class ServerArgs:
    host: str = setting("127.0.0.1", "address to listen on", group=HTTP)
    port: int = setting(8000, "port to listen on (0: any free one)", group=HTTP)
    served_model_name: str | None = setting(
        None, "the `model` clients ask for", group=HTTP, when_none="the model folder's name"
    )
    log_level: str = setting(
        "info", "uvicorn's log level", choices=("debug", "info", "warning"), group=HTTP
    )
    api_key: tuple[str, ...] = setting(
        (), "a key clients must send as `Authorization: Bearer KEY` on every route but /health, "
        "/ready and /metrics; repeat for several", metavar="KEY", group=LIMITS,
        when_none=f"${API_KEY_ENV}, else none: no authentication",
    )  # fmt: skip
    max_request_bytes: int = setting(
        4 * MIB, "largest request body accepted; larger ones get 413", group=LIMITS
    )
    request_body_timeout: float = setting(
        10.0, "seconds a request body may go without a byte arriving before its end; then 408 "
        "and the connection closes", metavar="SECONDS", group=LIMITS,
    )  # fmt: skip
    max_prompts_per_request: int = setting(
        256, "prompts one /v1/completions request may batch", group=LIMITS
    )
    max_sequences_per_request: int = setting(
        512, "sequences one request may start (prompts x n)", group=LIMITS
    )
    shutdown_timeout: float = setting(
        20.0, "on SIGTERM, seconds in-flight requests may take to finish before they are "
        "aborted and the server exits; a second signal exits at once", metavar="SECONDS",
        group=LIMITS,
    )  # fmt: skip
    response_store_max_entries: int = setting(
        1024, "responses /v1/responses keeps for GET and previous_response_id (least recently "
        "used evicted first; 0 keeps none)", metavar="N", group=LIMITS,
    )  # fmt: skip
    response_store_max_bytes: int = setting(
        64 * MIB, "bytes of memory those stored responses may hold (each kept as the JSON of "
        "its response and whole conversation)", metavar="N", group=LIMITS,
    )  # fmt: skip
    engine_stall_timeout: float = setting(
        60.0, "/ready (readiness) answers 503 while work is pending and the engine has not "
        "completed a step for this long: a slow server gets no new traffic, and is not "
        "restarted", metavar="SECONDS", group=LIMITS,
    )  # fmt: skip
    engine_hang_timeout: float = setting(
        600.0, "/health (liveness) answers 503 once the engine has been inside one step for "
        "this long, as when it has died: longer than any step should take on this hardware",
        metavar="SECONDS", group=LIMITS,
    )  # fmt: skip

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port < 65536, "port"),  # 0: any free port
            (all(self.api_key), "api_key"),
            (self.max_request_bytes > 0, "max_request_bytes"),
            (self.request_body_timeout > 0, "request_body_timeout"),
            (self.max_prompts_per_request > 0, "max_prompts_per_request"),
            (self.max_sequences_per_request > 0, "max_sequences_per_request"),
            (self.shutdown_timeout >= 0, "shutdown_timeout"),
            (self.engine_stall_timeout > 0, "engine_stall_timeout"),
            (self.engine_hang_timeout > 0, "engine_hang_timeout"),
            (self.response_store_max_entries >= 0, "response_store_max_entries"),
            (self.response_store_max_bytes >= 0, "response_store_max_bytes"),
        ]
        for ok, name in checks:
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name)!r}")
