"""The fault campaign's fixed-seed slice (tests/chaos.py), on the test session's Ray: scenarios drawn from one seed
(here one: a fault inside a save, then the driver interrupted and resumed), each run as a user runs it and held
to every invariant. `python tests/chaos.py --seed N --runs M` runs
the long campaign."""

from __future__ import annotations

import pytest

from chaos import Campaign, draw

# One scenario (about a minute): ZeRO-1, a rank killed in the all-reduce of step 5 while the save of step 4 is in
# flight, then the driver's Ctrl-C at step 10 and its resume. The campaign draws the rest.
SEED, RUNS = 87, 1


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
