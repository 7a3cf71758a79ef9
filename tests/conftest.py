"""Shared fixtures: converted real models (fetched once into the kvserve cache)."""

from __future__ import annotations

import os

import pytest

# The Triton interpreter's dots run in numpy; threaded BLAS on 2 shared cores only thrashes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Triton kernels run under the interpreter when there is no GPU; set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="session")
def smollm2_dir():
    from models.fetch import fetch

    return fetch("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def gemma3_dir():
    from models.fetch import fetch

    return fetch("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def qwen05_dir():
    """Qwen2.5-Coder-0.5B-Instruct, served from its GGUF file in its block formats."""
    from models.fetch import fetch

    return fetch("qwen2.5-coder-0.5b-instruct", progress=False)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module of small matrices: a second thread only adds
    synchronisation, and on a shared CPU much more."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint (no tokenizer: prompts are token ids)."""
    from tests.helpers import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="session")
def worded_llama_dir(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's tokenizer (and its vocabulary), for commands that read
    text."""
    import shutil

    from tests.helpers import save_tiny_llama

    path = tmp_path_factory.mktemp("worded-llama")
    save_tiny_llama(path, hidden_size=128, vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path
