"""KV events on the wire, as vLLM publishes them: ``--kv-events-config '<json>'``.

A cluster router (llm-d's KV-cache indexer behind the Gateway API inference extension's endpoint
picker) subscribes to each replica's events to learn which prefixes it holds, and sends a
request where its prefix is cached. kvserve speaks vLLM's protocol unchanged
(``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``):

- the config's keys and defaults are vLLM's: ``enable_kv_cache_events`` (false),
  ``publisher`` (``"zmq"`` when enabled, else ``"null"``), ``endpoint`` (``tcp://*:5557``),
  ``replay_endpoint`` (none), ``buffer_steps`` (10,000), ``hwm`` (100,000), ``max_queue_size``
  (100,000), ``topic`` (``""``; llm-d reads ``kv@<pod>@<model>``); kvserve adds ``encoding``:
  ``"map"`` (each event a map with a ``type`` key, as vLLM sends since v0.26) or ``"array"``
  (positional, ``[type, fields...]``, as llm-d's indexer before v0.9 decodes);
- a ZMQ PUB socket that binds when the endpoint has ``*`` or ``::`` or is ``ipc://`` or
  ``inproc://``, and connects otherwise; each engine step with events is one message of three
  frames: the topic, an 8-byte big-endian sequence number counting from 0, and the msgpack
  batch ``[timestamp, events, 0]`` (the 0: the data-parallel rank);
- with a ``replay_endpoint``, a ROUTER socket keeps the last ``buffer_steps`` batches: a
  DEALER that sends ``[b"", start]`` (8 bytes, big-endian) gets ``[b"", topic, seq, payload]``
  for every kept batch from ``start`` on, then ``[b"", topic, -1, b""]``.

The events come from the prefix cache's pools (``engine.core.kv_events``). A thread sends them,
so that a slow network never holds up a step; past ``max_queue_size`` waiting batches, new ones
are dropped and counted (``dropped``), as vLLM's publisher does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgpack
import zmq

from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)
ENCODINGS = ("map", "array")
# The fields of each event in vLLM's order: the positional form sends them so, after the type.
FIELDS = {
    BlockStored: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx"),
    BlockRemoved: ("block_hashes", "medium", "group_idx"),
    AllBlocksCleared: (),
}  # fmt: skip


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null" (vLLM's default)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The config a ``--kv-events-config`` JSON object gives; ValueError says what is
        wrong with it in one line."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: {list(fields)}")
        config = cls(**given)
        config.check()
        return config

    def check(self) -> None:
        kinds = {"enable_kv_cache_events": bool, "endpoint": str, "buffer_steps": int,
                 "hwm": int, "max_queue_size": int, "topic": str}  # fmt: skip
        for name, kind in kinds.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and value < 0):
                raise ValueError(f"--kv-events-config: {name} must be a {kind.__name__}")
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError("--kv-events-config: publisher must be 'zmq' or 'null'")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-config: encoding must be one of {ENCODINGS}")

    @property
    def enabled(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def encode_event(event: KVEvent, encoding: str) -> dict | list:
    """One event as vLLM's msgspec structs serialize it: a map tagged ``type``, or the type
    name then the fields in order."""
    values = {"lora_id": None, "lora_name": None, "extra_keys": None, **vars(event)}
    names = FIELDS[type(event)]
    kind = type(event).__name__
    if encoding == "array":
        return [kind, *(values[n] for n in names)]
    return {"type": kind, **{n: values[n] for n in names}}


def encode_batch(ts: float, events: list[KVEvent], encoding: str) -> bytes:
    return msgpack.packb([ts, [encode_event(e, encoding) for e in events], 0])


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """Publishes each step's events from a thread of its own (``publish`` never blocks)."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.topic = config.topic.encode()
        self.dropped = 0
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open the endpoint: {e}") from None
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(encode_batch(time.time(), events, self.config.encoding))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the send queue is full; batches are being dropped")

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        seq = 0
        try:
            while True:
                try:
                    payload = self._queue.get(timeout=0.05)
                except queue.Empty:
                    self._answer_replays()
                    continue
                if payload is None:
                    return
                number = seq.to_bytes(8, "big")
                self._pub.send_multipart([self.topic, number, payload])
                self._kept.append((seq, payload))
                seq += 1
                self._answer_replays()
        finally:
            self._close_sockets()

    def _answer_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            identity, start = frames[0], int.from_bytes(frames[-1][:8], "big", signed=True)
            for seq, payload in list(self._kept):
                if seq >= start:
                    self._replay.send_multipart(
                        [identity, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            end = (-1).to_bytes(8, "big", signed=True)
            self._replay.send_multipart([identity, b"", self.topic, end, b""])

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(0)
        self._context.term()
