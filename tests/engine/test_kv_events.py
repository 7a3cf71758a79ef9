"""KV events as a cluster router receives them (``--kv-events-config``), read by subscribers
written here from vLLM's published format (pyzmq and msgpack, not kvserve's encoder), and a
router that rebuilds llm-d's request keys (FNV-64a over canonical CBOR of 16-token blocks,
chained from the model name) and routes returning conversations between two replicas."""

from __future__ import annotations

import json
import socket
import time

import cbor2
import msgpack
import pytest
import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from tests.helpers import random_prompt

BS = 16
MODEL = "tiny"
STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
          "lora_name", "extra_keys", "group_idx")  # fmt: skip
REMOVED = ("block_hashes", "medium", "group_idx")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica(path, port: int, pod: str, encoding: str = "map", **extra) -> LLM:
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "topic": f"kv@{pod}@{MODEL}", "encoding": encoding, **extra}  # fmt: skip
    return LLM(str(path), num_kv_blocks=24, block_size=BS, kv_events_config=json.dumps(config))


class Subscriber:
    """A SUB socket on the given publishers; ``messages`` reads every 3-frame message until
    the sockets stay quiet."""

    def __init__(self, ports: list[int]):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        for port in ports:
            self.sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # a PUB drops what it sends before the subscription reaches it

    def messages(self, quiet_s: float = 0.5) -> list[tuple[str, int, list]]:
        out = []
        while self.sub.poll(int(quiet_s * 1000)):
            frames = self.sub.recv_multipart()
            assert len(frames) == 3 and len(frames[1]) == 8
            out.append((frames[0].decode(), int.from_bytes(frames[1], "big"),
                        msgpack.unpackb(frames[2])))  # fmt: skip
        return out

    def close(self) -> None:
        self.sub.close(0)
        self.context.term()


def event(raw) -> dict:
    """An event as a map, from either form."""
    if isinstance(raw, dict):
        return raw
    kind, *values = raw
    names = {"BlockStored": STORED, "BlockRemoved": REMOVED, "AllBlocksCleared": ()}[kind]
    return {"type": kind, **dict(zip(names, values))}


def generate(llm: LLM, prompts: list[list[int]]) -> None:
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_subscriber_sees_each_block_stored_removed_and_cleared(tiny_llama_dir, encoding):
    port, replay = free_port(), free_port()
    llm = replica(tiny_llama_dir, port, "pod-a", encoding,
                  replay_endpoint=f"tcp://*:{replay}")  # fmt: skip
    sub = Subscriber([port])
    try:
        prompts = [random_prompt(16 * 3 + 5, 128, seed) for seed in range(2)]
        generate(llm, prompts)
        llm.reset_prefix_cache()
        messages = sub.messages()
        assert [seq for _, seq, _ in messages] == list(range(len(messages)))
        assert {topic for topic, _, _ in messages} == {f"kv@pod-a@{MODEL}"}
        events = []
        for _, _, batch in messages:
            ts, raw, rank = batch
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
            assert all(isinstance(e, dict if encoding == "map" else list) for e in raw)
            events += [event(e) for e in raw]
        stored = [e for e in events if e["type"] == "BlockStored"]
        # Every full block of each prompt, its tokens in order; a parent announced first.
        known = set()
        for e in stored:
            assert e["block_size"] == BS and e["medium"] == "GPU" and e["lora_id"] is None
            assert e["parent_block_hash"] is None or e["parent_block_hash"] in known
            assert len(e["token_ids"]) == BS * len(e["block_hashes"])
            assert all(0 <= h < 2**64 for h in e["block_hashes"])
            known.update(e["block_hashes"])
        for p in prompts:
            chains = [e["token_ids"] for e in stored if e["token_ids"][:BS] == p[:BS]]
            assert p[: 3 * BS] in [c[: 3 * BS] for c in chains]
        assert events[-1] == {"type": "AllBlocksCleared"}
        # A subscriber that joins late asks the replay socket from batch 1 on.
        dealer = sub.context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(5000):
            empty, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        assert replayed == [(seq, batch) for _, seq, batch in messages[1:]]
        dealer.close(0)
    finally:
        sub.close()
        llm.engine.shutdown()


def test_a_full_pool_removes_what_it_reuses(tiny_llama_dir):
    port = free_port()
    llm = replica(tiny_llama_dir, port, "pod-a")
    sub = Subscriber([port])
    try:
        # 24 blocks: four prompts of 7 blocks each reuse the first ones' cached blocks.
        for seed in range(4):
            generate(llm, [random_prompt(16 * 7, 128, seed)])
        events = [event(e) for _, _, batch in sub.messages() for e in batch[1]]
        stored = {h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed and set(removed) <= stored and len(set(removed)) == len(removed)
    finally:
        sub.close()
        llm.engine.shutdown()


def test_vllms_own_event_classes_decode_the_batches(tiny_llama_dir):
    """Where vLLM is installed, its msgspec classes read what kvserve sends."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    msgspec = pytest.importorskip("msgspec")
    port = free_port()
    llm = replica(tiny_llama_dir, port, "pod-a")
    sub = Subscriber([port])
    try:
        generate(llm, [random_prompt(40, 128, 0)])
        decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        sub_raw = [m for m in sub.messages()]
        assert sub_raw
        for _, _, batch in sub_raw:
            decoded = decoder.decode(msgpack.packb(batch))
            assert all(type(e).__name__ == "BlockStored" for e in decoded.events)
    finally:
        sub.close()
        llm.engine.shutdown()


class Router:
    """llm-d's KV-cache indexer, rebuilt from its documented behaviour: request keys are
    FNV-64a over canonical CBOR of [parent key, block tokens, extra], chained from a root made of
    the model name; an engine's block hashes are mapped to request keys when stored; a block
    whose parent it does not know is skipped; a prompt scores per pod its longest run of
    cached request keys from the first."""

    def __init__(self, model: str):
        self.root = self.hash(self.fnv(b""), None, model)
        self.engine_to_request: dict[tuple[str, int], int] = {}
        self.pods: dict[int, set[str]] = {}

    @staticmethod
    def fnv(data: bytes) -> int:
        h = 0xCBF29CE484222325
        for byte in data:
            h = ((h ^ byte) * 0x100000001B3) % 2**64
        return h

    def hash(self, parent: int, tokens, extra) -> int:
        return self.fnv(cbor2.dumps([parent, tokens, extra], canonical=True))

    def request_keys(self, tokens: list[int]) -> list[int]:
        keys, parent = [], self.root
        for i in range(len(tokens) // BS):
            parent = self.hash(parent, tokens[i * BS : (i + 1) * BS], None)
            keys.append(parent)
        return keys

    def consume(self, topic: str, batch: list) -> None:
        pod = topic.split("@")[1]
        for e in map(event, batch[1]):
            if e["type"] == "BlockStored":
                parent = e["parent_block_hash"]
                if parent is None:
                    key = self.root
                elif (pod, parent) in self.engine_to_request:
                    key = self.engine_to_request[pod, parent]
                else:
                    continue
                tokens = e["token_ids"]
                for i, h in enumerate(e["block_hashes"]):
                    key = self.hash(key, tokens[i * BS : (i + 1) * BS], None)
                    self.engine_to_request[pod, h] = key
                    self.pods.setdefault(key, set()).add(pod)
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    key = self.engine_to_request.pop((pod, h), None)
                    if key is not None:
                        self.pods.get(key, set()).discard(pod)
            else:
                for key in self.pods.values():
                    key.discard(pod)

    def route(self, tokens: list[int], pods: list[str]) -> str | None:
        best, most = None, 0
        for pod in pods:
            run = 0
            for key in self.request_keys(tokens):
                if pod not in self.pods.get(key, ()):
                    break
                run += 1
            if run > most:
                best, most = pod, run
        return best


def test_a_router_fed_by_two_replicas_sends_returning_conversations_home(tiny_llama_dir):
    ports = [free_port(), free_port()]
    pods = ["pod-a", "pod-b"]
    replicas = [replica(tiny_llama_dir, port, pod) for port, pod in zip(ports, pods)]
    sub = Subscriber(ports)
    router = Router(MODEL)
    try:
        conversations = [random_prompt(16 * 3 + 3, 128, seed) for seed in range(10)]
        home = {}
        for i, prompt in enumerate(conversations):
            home[i] = i % 2
            generate(replicas[i % 2], [prompt])
        for topic, _, batch in sub.messages():
            router.consume(topic, batch)
        # Each conversation returns with its history and a new turn.
        sent_home = sum(
            router.route(prompt + random_prompt(20, 128, 100 + i), pods) == pods[home[i]]
            for i, prompt in enumerate(conversations)
        )
        assert sent_home >= 0.9 * len(conversations)
        replicas[0].reset_prefix_cache()
        for topic, _, batch in sub.messages():
            router.consume(topic, batch)
        assert router.route(conversations[0], pods) is None  # pod-a forgot it; no one has it
        assert router.route(conversations[1], pods) == "pod-b"
    finally:
        sub.close()
        for llm in replicas:
            llm.engine.shutdown()


def test_a_malformed_config_is_refused_in_one_line(tiny_llama_dir):
    for config, words in (("{", "not JSON"), ('{"endpont": "x"}', "unknown keys"),
                          ('{"enable_kv_cache_events": true, "encoding": "cbor"}', "encoding"),
                          ('{"enable_kv_cache_events": true, "endpoint": "bogus://x"}',
                           "cannot open")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            LLM(str(tiny_llama_dir), num_kv_blocks=8, kv_events_config=config)


def test_an_endpoint_picker_reads_one_usage_series_and_integer_cache_info(tiny_llama_dir):
    """The Gateway API inference extension's vllm mapping: the first series of each name, and
    ``block_size`` and ``num_gpu_blocks`` labels that parse as integers."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=24, block_size=BS)
    generate(llm, [random_prompt(40, 128, 0)])
    text = generate_latest(llm.engine.metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):  # fmt: skip
        (sample,) = families[name].samples
        assert sample.labels == {} and 0 <= sample.value <= 1
    (info,) = families["vllm:cache_config_info"].samples
    assert int(info.labels["block_size"]) == BS and int(info.labels["num_gpu_blocks"]) == 24
