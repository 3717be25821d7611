"""``kvcanary sim --transfer-digest``: transfers through a host tier with a digest checked there and on
arrival (issue 24).  Every transfer fault class is caught, attributed to its request, by the verdict
it must give; clean transfers are all MATCH and a clean run reports nothing."""

import json

import pytest

from kvcanary_cupy import cli
from kvcanary_cupy.sim import EngineConfig, SimConfig, simulate
from kvcanary_cupy.sim.transfer import TRANSFER_FAULTS

REASON = {"transfer_never_landed": "digest_mismatch_kv", "transfer_partial": "digest_mismatch_kv",
          "transfer_wrong_owner": "digest_mismatch_rec", "transfer_layout_mismatch": "digest_mismatch_kv",
          "host_tier_bitflip": "digest_mismatch_kv", "reload_wrong_slots": "digest_mismatch_kv",
          "sender_sends_no_digest": "digest_missing"}


@pytest.fixture(scope="module", params=[("full", "sglang"), ("default", "vllm")])
def transfer_run(request):
    mode, addressing = request.param
    config = SimConfig(steps=260, seed=3, rate=1.0, faults=tuple(TRANSFER_FAULTS), addressing=addressing,
                       engine=EngineConfig(transfer_digest=mode))
    return simulate(config), simulate(SimConfig(steps=260, seed=3, faults=(), addressing=addressing,
                                                engine=EngineConfig(transfer_digest=mode)))


@pytest.mark.parametrize("name", list(TRANSFER_FAULTS))
def test_every_transfer_fault_is_caught_by_its_verdict(transfer_run, name):
    (results, stats), _ = transfer_run
    f = next(r for r in results if r.name == name)
    assert f.injected >= 2 and f.detected == f.injected and f.detectable
    assert f.first_reason.split("+")[0] == REASON[name] or REASON[name] in f.first_reason
    assert max(f.latencies) == 0  # the verdict comes in the step of the transfer
    assert stats.unattributed == 0, stats.unattributed_examples


def test_clean_transfers_all_match(transfer_run):
    _, (_, clean) = transfer_run
    verdicts = clean.engine_counters["digest_verdicts"]
    assert set(verdicts["OFFLOAD"]) == set(verdicts["TRANSFER"]) == {"MATCH"}
    assert verdicts["TRANSFER"]["MATCH"] >= 40
    assert clean.violations == 0


def test_transfer_faults_need_the_digest():
    with pytest.raises(ValueError, match="transfer_partial acts on the digested transfer path; pass --transfer-digest"):
        SimConfig(faults=("transfer_partial",))
    with pytest.raises(ValueError, match="transfer_digest must be one of off, full, default, got 'half'"):
        SimConfig(engine=EngineConfig(transfer_digest="half"))


def test_cli_runs_the_transfer_classes(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert cli.main(["sim", "--steps", "60", "--seed", "2", "--rate", "1", "--faults", "transfer", "--transfer-digest",
                     "full", "--plot", "", "--quiet", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [f["name"] for f in doc["faults"]] == list(TRANSFER_FAULTS)
    assert all(f["detected"] == f["injected"] for f in doc["faults"]) and sum(f["injected"] for f in doc["faults"]) >= 3
    assert doc["clean"]["false_positives"] == 0
