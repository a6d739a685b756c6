"""The fault campaign's fixed-seed slice (tests/chaos.py), on the test session's Ray: scenarios drawn from one seed
(a fault inside a save, a driver interrupted and resumed twice over, a refused commit; ZeRO-1, LoRA and pipeline
replicas), each run as a user runs it and held to every invariant. `python tests/chaos.py --seed N --runs M` runs
the long campaign."""

from __future__ import annotations

import pytest

from chaos import Campaign, draw

SEED, RUNS = 87, 3  # zero: kill_in_allreduce@5 (the save of step 4 in flight) + Ctrl-C@10; lora: Ctrl-C@3 + kill@7;
# pp2: the commit of step 8 refused


@pytest.mark.parametrize("scenario", draw(SEED, RUNS), ids=lambda s: s.name)
def test_a_drawn_fault_scenario_keeps_every_invariant(ray_session, data_dir, s3_faults, s3_bucket, campaign, scenario):
    outcome = campaign(s3_faults, s3_bucket).run(scenario)
    assert outcome.held, (scenario, outcome.violations, outcome.drivers)


@pytest.fixture(scope="module")
def campaign(data_dir, tmp_path_factory):
    """One campaign for the slice: its references and its base are made once."""
    made = {}

    def get(s3, bucket):
        made.setdefault("c", Campaign(tmp_path_factory.mktemp("chaos"), data_dir))
        made["c"].s3, made["c"].bucket = s3, bucket
        return made["c"]

    return get
