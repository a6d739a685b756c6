"""One typed config tree, from YAML preset + `--set` overrides to every worker.

Each component owns its section; `Config` composes them. The resolved tree is
saved as `config.yaml` in the run directory and travels inside checkpoints, so a
run can always be reproduced or resumed from what it wrote.

Its modules, one job each (everything is imported from here, `etrain.core.config`):

    base.py        Section, what every section holds to, and ConfigError
    model.py       model: the family and shape of the model
    data.py        data, prepare: the corpus, its shards and caches; how raw documents become one
    training.py    train, optim: the steps, the batch, the guards; the optimizer and its schedule
    parallel.py    parallel, comm, balance: a replica's layout, gradient sync, the batch's split
    cluster.py     cluster, timeouts: the workers; the bound on every wait
    checkpoint.py  checkpoint, run: what a run keeps on disk, and where
    faults.py      faults, health: failures injected and foreseen
    finetune.py    finetune (LoRA), ppo: training from a trained model
    root.py        Config: the sections composed; RESUMABLE and a run's identity (hash)
    rules.py       the rules that span sections (Config's validators)
    memory.py      a rank's memory by part, by arithmetic
    loading.py     presets, YAML files, `--set` overrides, validation and its messages
"""

from etrain.core.config.base import ConfigError, Section
from etrain.core.config.checkpoint import CheckpointConfig, RunConfig
from etrain.core.config.cluster import ClusterConfig, TimeoutConfig
from etrain.core.config.data import DataConfig, PrepareConfig, TrainedTokenizer
from etrain.core.config.faults import Fault, HealthConfig
from etrain.core.config.finetune import FinetuneConfig, LoraConfig, PPOConfig, targeted
from etrain.core.config.loading import PRESET_DIR, load_config, override, raw_config, resolve_preset, validate
from etrain.core.config.model import ModelConfig, RopeScaling
from etrain.core.config.parallel import BalanceConfig, CommConfig, Coords, DilocoConfig, ParallelConfig
from etrain.core.config.root import RESUMABLE, Config
from etrain.core.config.training import OptimConfig, TrainConfig

__all__ = [
    "PRESET_DIR",
    "RESUMABLE",
    "BalanceConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CommConfig",
    "Config",
    "ConfigError",
    "Coords",
    "DataConfig",
    "DilocoConfig",
    "Fault",
    "FinetuneConfig",
    "HealthConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "PPOConfig",
    "ParallelConfig",
    "PrepareConfig",
    "RopeScaling",
    "RunConfig",
    "Section",
    "TimeoutConfig",
    "TrainConfig",
    "TrainedTokenizer",
    "load_config",
    "override",
    "raw_config",
    "resolve_preset",
    "targeted",
    "validate",
]
