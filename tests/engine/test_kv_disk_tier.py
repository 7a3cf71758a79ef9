"""The disk tier of the prefix cache (``--kv-disk-cache-dir``): blocks the host tier evicts go
to files, come back up for returning requests, and outlive the server. The oracle is the same
engine without tiers: greedy tokens must be identical, whatever the files went through."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.worker.disk_tier import MAGIC, SUFFIX, split_file
from tests.helpers import random_prompt, save_tiny_llama

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# A few blocks of the tiny model (3 to 7), fewer than four conversations of 5 blocks take.
HOST_GIB = {"float32": 6e-5, "bfloat16": 3e-5, "float16": 3e-5, "int8": 1.6e-5,
            "fp8_e4m3": 1.6e-5, "int8/int4": 1.3e-5}  # fmt: skip
DISK_GIB = 0.01


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-disk")
    save_tiny_llama(path, hidden_size=128)
    return path


def engine(path, disk: Path | None, **kw) -> LLM:
    host = HOST_GIB[kw.get("kv_cache_dtype", "float32")]
    tiers = dict(kv_host_cache_gib=host, kv_disk_cache_dir=str(disk), kv_disk_cache_gib=DISK_GIB)
    return LLM(str(path), num_kv_blocks=16, block_size=BS, **(tiers if disk else {}), **kw)


def first_turns() -> list[list[int]]:
    return [random_prompt(5 * BS + 3, 128, seed) for seed in range(4)]


def conversation_rounds(llm: LLM) -> list:
    """Four conversations of 5 blocks in a device pool of 16, each returning with its history
    and a new turn once the others have pushed it out of the device and host pools."""
    first = first_turns()
    outs = [llm.generate([p], GREEDY)[0] for p in first]
    again = [p + o.outputs[0].token_ids + random_prompt(7, 128, 50 + i)
             for i, (p, o) in enumerate(zip(first, outs))]  # fmt: skip
    return outs + [llm.generate([p], GREEDY)[0] for p in again]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def counter(llm: LLM, name: str, **labels) -> float:
    return llm.engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(f"*{SUFFIX}"))


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return tokens(conversation_rounds(engine(tiny_llama_dir, None)))


@pytest.mark.parametrize("kv_dtype", list(HOST_GIB))
def test_blocks_go_to_disk_and_come_back_with_the_same_tokens(tiny_llama_dir, tmp_path, kv_dtype):
    plain = tokens(conversation_rounds(engine(tiny_llama_dir, None, kv_cache_dtype=kv_dtype)))
    llm = engine(tiny_llama_dir, tmp_path, kv_cache_dtype=kv_dtype)
    assert tokens(conversation_rounds(llm)) == plain
    hits = counter(llm, "kvserve:prefix_cache_disk_hits_total")
    loaded = counter(llm, "kvserve:kv_disk_tier_blocks_total", direction="loaded")
    assert hits > 0 and loaded * BS == hits
    stored = counter(llm, "kvserve:kv_disk_tier_blocks_total", direction="stored")
    kv = llm.engine.kv
    assert len(block_files(tmp_path)) == kv.num_cached_disk_blocks <= stored
    assert sum(f.stat().st_size for f in block_files(tmp_path)) <= DISK_GIB * 2**30
    kv.check_integrity([])
    llm.reset_prefix_cache()
    llm.generate([[1, 2, 3]], GREEDY)  # a step carries the drops out
    assert kv.num_cached_disk_blocks == 0 and not block_files(tmp_path)


def test_a_restarted_server_finds_its_blocks_and_skips_bad_files(tiny_llama_dir, plain, tmp_path):
    conversation_rounds(engine(tiny_llama_dir, tmp_path))
    files = block_files(tmp_path)
    assert len(files) >= 4
    # A flipped payload byte, a file cut short, another store's block, a write cut off.
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    files[1].write_bytes(files[1].read_bytes()[: len(MAGIC) + 40])
    n = int.from_bytes(files[2].read_bytes()[len(MAGIC) : len(MAGIC) + 4], "little")
    header = json.loads(files[2].read_bytes()[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    header["fingerprint"]["block_size"] = 32
    body = json.dumps(header).encode()
    rest = files[2].read_bytes()[len(MAGIC) + 4 + n :]
    files[2].write_bytes(MAGIC + len(body).to_bytes(4, "little") + body + rest)
    (files[3].parent / f".{files[3].name}.123.tmp").write_bytes(files[3].read_bytes()[:100])

    llm = engine(tiny_llama_dir, tmp_path)
    assert counter(llm, "kvserve:kv_disk_tier_blocks_total", direction="corrupt") == 3
    assert llm.engine.kv.num_cached_disk_blocks == len(files) - 3
    first = [llm.generate([p], GREEDY)[0] for p in first_turns()]
    assert tokens(first) == plain[:4]
    assert sum(o.num_cached_tokens for o in first) > 0  # found on disk, not computed again
    assert counter(llm, "kvserve:prefix_cache_disk_hits_total") > 0


def test_a_kill_while_writing_leaves_the_tier_loadable(tiny_llama_dir, plain, tmp_path):
    """A server killed (SIGKILL) halfway through writing a block file: the next start loads
    every complete file and serves the same tokens."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path.cwd())!r})
        from engine.worker import disk_tier
        from tests.engine.test_kv_disk_tier import conversation_rounds, engine
        from pathlib import Path
        written = []
        real = disk_tier.DiskStore._write
        def write(self, group, key, tokens, payload):
            if len(written) == 3:  # the fourth file: half of it, then killed
                tmp = self._path(group, key).with_name(f".{{key.hex()}}.{{os.getpid()}}.tmp")
                tmp.write_bytes(disk_tier.MAGIC + payload[: len(payload) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            written.append(key)
            real(self, group, key, tokens, payload)
        disk_tier.DiskStore._write = write
        conversation_rounds(engine(Path({str(tiny_llama_dir)!r}), Path({str(tmp_path)!r})))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert len(block_files(tmp_path)) == 3
    llm = engine(tiny_llama_dir, tmp_path)
    assert llm.engine.kv.num_cached_disk_blocks == 3
    assert counter(llm, "kvserve:kv_disk_tier_blocks_total", direction="corrupt") == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != SUFFIX]
    assert tokens(conversation_rounds(llm)) == plain


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(kv_disk_cache_dir="x"), "needs --kv-disk-cache-gib"),
        (dict(kv_disk_cache_gib=1.0), "give both"),
        (dict(kv_disk_cache_dir="x", kv_disk_cache_gib=1.0), "needs --kv-host-cache-gib"),
    ],
)
def test_disk_flags_that_do_not_go_together_are_refused(tiny_llama_dir, kw, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), num_kv_blocks=16, block_size=BS, **kw)


def test_the_folder_is_named_for_what_its_blocks_belong_to(tiny_llama_dir, tmp_path):
    """Another KV dtype (or model, block size...) writes into a folder of its own: neither
    store reads the other's blocks."""
    for kv_dtype in ("float32", "int8"):
        conversation_rounds(engine(tiny_llama_dir, tmp_path, kv_cache_dtype=kv_dtype))
    folders = {f.parent for f in block_files(tmp_path)}
    assert len(folders) == 2
    assert os.path.commonpath(list(folders)) == str(tmp_path)


def test_an_mla_cache_goes_to_disk_once_per_row(tmp_path_factory, tmp_path):
    """DeepSeek's latent cache: the values are the latent part of each key row, written once."""
    from tests.helpers import save_tiny_deepseek_v3

    path = tmp_path_factory.mktemp("tiny-deepseek-disk")
    save_tiny_deepseek_v3(path)
    kw = dict(num_kv_blocks=16, block_size=BS)
    plain = tokens(conversation_rounds(LLM(str(path), **kw)))
    tiers = dict(kv_host_cache_gib=2e-5, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gib=0.01)
    llm = LLM(str(path), **kw, **tiers)
    assert tokens(conversation_rounds(llm)) == plain
    assert counter(llm, "kvserve:prefix_cache_disk_hits_total") > 0
    (group,) = llm.engine.cache_config.groups
    payloads = {len(split_file(f.read_bytes())[1]) for f in block_files(tmp_path)}
    assert payloads == {BS * group.bytes_per_token}  # a latent row once, not as K and as V


@pytest.mark.parametrize("case", ["swap", "shift"])
def test_preemption_and_shift_give_the_same_tokens(tiny_llama_dir, tmp_path, case):
    """Swap shares the host pool the disk tier writes down from; a shift re-rotates blocks
    the tiers may hold copies of."""
    if case == "swap":
        prompts = [random_prompt(3 * BS + 5, 128, seed) for seed in range(6)]
        prompts += [p + random_prompt(9, 128, 90 + i) for i, p in enumerate(prompts[:3])]
        kw = dict(num_kv_blocks=12, preemption_mode="swap", swap_space_gib=0.0001)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    else:
        prompts = [random_prompt(40, 128, seed) for seed in range(3)] * 2
        kw = dict(num_kv_blocks=10, max_model_len=96, context_overflow="shift")
        params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    runs = []
    for disk in (None, tmp_path):
        llm = LLM(str(tiny_llama_dir), block_size=BS, **kw, **(dict(
            kv_host_cache_gib=HOST_GIB["float32"], kv_disk_cache_dir=str(disk),
            kv_disk_cache_gib=DISK_GIB) if disk else {}))  # fmt: skip
        runs.append([llm.generate([p], params)[0].outputs[0].token_ids for p in prompts])
    assert runs[1] == runs[0]
    assert block_files(tmp_path)
