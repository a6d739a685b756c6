"""One local Ray instance per test session; a shared small embedded corpus."""

from __future__ import annotations

import pytest
import ray

from app.config import Config, load_config


@pytest.fixture(scope="session")
def ray_session():
    if ray.is_initialized():
        yield
        return
    # 4 logical CPUs on 2 cores: room for 3 workers; a test never shares a core budget with another suite.
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data"))


@pytest.fixture
def make_cfg(data_dir, tmp_path):
    """The tiny preset on a small corpus with several shards, writing under tmp_path."""

    def make(*overrides: str) -> Config:
        base = [
            f"data.cache_dir={data_dir}", "data.corpus_bytes=1500000", "data.shard_bytes=200000",
            f"run.root={tmp_path / 'runs'}", "train.steps=8", "train.eval_every=4", "checkpoint.every=4",
        ]
        return load_config("tiny", [*base, *overrides])

    return make
