"""`stalwart sim` (sim/) and the checkpoint-interval formulas (policy/interval.py)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from stalwart.policy import interval
from stalwart.sim.engine import BADPUT, POLICIES, Policy, SimJob, simulate, simulate_side_by_side
from stalwart.sim.failures import LLAMA3_CAUSES, FailureModel
from stalwart.sim.outages import CHOICES, Regions
from stalwart.sim.profiles import PROFILES, STALWART
from stalwart.sim.regions import Prices, outcome, study


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    """`stalwart sim ARGS` in this process (the CLI's own entry point, its exit status and both streams): the
    same as a subprocess without a second torch import per call."""
    from stalwart.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["sim", *args])
    return subprocess.CompletedProcess(["stalwart", "sim", *args], code, out.getvalue(), err.getvalue())


def test_the_formulas_match_their_papers() -> None:
    assert [round(interval.daly(300, h * 3600) / 60, 1) for h in (24, 6, 0.25)] == [116.7, 56.7, 9.1]  # Daly 2006
    assert interval.young(60, 3600) == pytest.approx(657.27, abs=0.01)
    assert interval.daly(60, 3600) == pytest.approx(interval.optimum_by_search(60, 3600, 300), rel=1e-3)
    assert interval.daly(10, 4) == 4, "C >= 2M: checkpoint every MTBF"
    assert interval.availability_optimal(60, 3600, 300) == pytest.approx(60 + (2 * 3900 * 60 + 3600) ** 0.5)
    with pytest.raises(ValueError, match="positive"):
        interval.young(0, 3600)


def test_the_llama3_setup_has_its_interruptions_and_their_causes() -> None:
    r = simulate(SimJob(16384, 54), FailureModel.named("llama3"), PROFILES["torchrun"], Policy("daly"), runs=32)
    assert r.interruptions == pytest.approx(419, rel=0.05) and r.job_mtbf_h == pytest.approx(3.09, abs=0.01)
    for cause in LLAMA3_CAUSES[:3]:
        assert r.by_cause[cause.name] == pytest.approx(cause.count, rel=0.15), cause.name


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("policy", POLICIES)
def test_every_second_of_the_wall_clock_is_accounted_for(profile: str, policy: str) -> None:
    for spares in (0, 16):
        r = simulate(SimJob(16384, 20, spares=spares), FailureModel.named("llama3"), PROFILES[profile], Policy(policy),
                     runs=8)  # fmt: skip
        assert r.ettr + sum(r.badput.values()) == pytest.approx(1.0, abs=1e-9)
        assert set(r.badput) == set(BADPUT) and all(v >= -1e-12 for v in r.badput.values())
        assert 0.5 < r.ettr < 1.0


def test_the_simulator_converges_to_dalys_complete_model() -> None:
    from stalwart.sim.validate import checks

    by_name = {c.what: c for c in checks()}
    for name in ("simulated ETTR vs Daly's complete model (the worst of 11 intervals)",
                 "simulator's optimum interval vs Daly's formula (s)"):  # fmt: skip
        assert by_name[name].ok, by_name[name]
    assert by_name["simulator's optimum interval vs Daly's formula (s)"].error < 0.01


def test_spares_remove_the_wait_for_a_node_and_the_adaptive_policy_learns_the_rate() -> None:
    model = FailureModel.named("llama3")
    none = simulate(SimJob(16384, 54, spares=0), model, STALWART, Policy("adaptive"), runs=16)
    many = simulate(SimJob(16384, 54, spares=64), model, STALWART, Policy("adaptive"), runs=16)
    assert none.badput["waiting_for_node"] > 0.02 and many.badput["waiting_for_node"] == 0.0
    assert many.ettr > none.ettr and many.gpu_hours > none.gpu_hours
    known = simulate(SimJob(16384, 54), model, STALWART, Policy("daly"), runs=16)
    assert many.snapshot_interval_s == pytest.approx(known.snapshot_interval_s, rel=0.1), "from a 24 h prior"
    slower = replace(STALWART, process_restart_s=60.0, node_swap_s=120.0)
    assert simulate(SimJob(16384, 54, spares=64), model, slower, Policy("adaptive"), runs=16).ettr < many.ettr


def test_weibull_failures_keep_the_mean_rate() -> None:
    exp = FailureModel.named("llama3")
    wei = FailureModel.named("llama3", weibull_shape=1.0)
    a = simulate(SimJob(16384, 54), exp, STALWART, Policy("daly"), runs=16).interruptions
    b = simulate(SimJob(16384, 54), wei, STALWART, Policy("daly"), runs=16).interruptions
    assert b == pytest.approx(a, rel=0.1), "shape 1 is exponential"
    early = FailureModel.named("llama3", weibull_shape=0.7)
    assert simulate(SimJob(16384, 54), early, STALWART, Policy("daly"), runs=16).interruptions > a, "infant mortality"


def test_stalwart_sim_alone_runs_the_llama3_setup(tmp_path: Path) -> None:
    plot = tmp_path / "sim.png"
    out = _sim("--json", "--runs", "16", "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["gpus"] == 16384 and report["days"] == 54 and report["failure_model"] == "llama3"
    rows = {(r["profile"], r["policy"]): r for r in report["results"]}
    assert set(rows) == {(p, q) for p in PROFILES for q in POLICIES}
    assert rows[("stalwart", "adaptive")]["ettr"] >= 0.98, "with the spares it picked"
    assert rows[("stalwart", "adaptive")]["ettr"] > rows[("torchrun", "daly")]["ettr"]
    best = min(report["spares_sweep"], key=lambda s: s["cost_per_useful_gpu_hour"])
    assert report["spares"] == best["spares"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "regions" not in report, "regions only when asked for"
    table = _sim("--runs", "4", "--profile", "stalwart", "--policy", "adaptive", "--spares", "8")
    assert table.returncode == 0 and "stalwart" in table.stdout and "adaptive" in table.stdout


def test_bad_input_is_one_clear_error(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text('{"restart_s": 3}')
    for args, message in ((["--gpus", "0"], "--gpus must be positive"), (["--policy", "best"], "invalid choice"),
                          (["--spares", "many"], "--spares must be a number"),
                          (["--costs", str(tmp_path / "no.json")], "does not exist"),
                          (["--costs", str(costs)], "unknown fields ['restart_s']"),
                          (["--plot", str(tmp_path / "x.txt"), "--spares", "0"], ".png or .svg"),
                          (["--region-outage-hours", "0"], "--region-outage-hours must be positive"),
                          (["--standby-fraction", "-0.5"], "--standby-fraction must be >= 0"),
                          (["--cross-region-gbps", "fast"], "--cross-region-gbps must be a number"),
                          (["--keep-last", "0"], "--keep-last must be positive")):  # fmt: skip
        out = _sim(*args)
        assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, (args, out.stderr)


def test_costs_can_come_from_this_machines_bench_report(tmp_path: Path) -> None:
    from stalwart.sim.profiles import load_costs

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"systems": {"stalwart": {"kill_to_step_s_median": 0.48, "hang_detect_s": 0.52},
                                             "torchrun": {"kill_to_step_s_median": 5.72}}}))  # fmt: skip
    profile = load_costs(STALWART, bench)
    assert profile.process_restart_s == pytest.approx(0.38) and profile.detect_hang_s == 0.52
    assert profile.node_swap_s == STALWART.node_swap_s, "what the bench does not measure stays"
    out = _sim("--costs", str(bench), "--runs", "4", "--spares", "32", "--profile", "stalwart", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["profiles"]["stalwart"]["process_restart_s"] == pytest.approx(0.38)


REGIONS_JOB = SimJob(4096, 30, spares=8)


def _choices(regions: Regions, runs: int = 16) -> dict[str, object]:
    model = FailureModel.named("llama3")
    return {
        c: outcome(REGIONS_JOB, model, STALWART, Policy("adaptive"), replace(regions, choice=c), Prices(), runs=runs)
        for c in CHOICES
    }


def test_without_regional_outages_every_choice_trains_alike_and_single_is_cheapest() -> None:
    model = FailureModel.named("llama3")
    alone = simulate(REGIONS_JOB, model, STALWART, Policy("adaptive"), runs=16)
    calm = Regions(outages_per_year=0.0)
    for choice in CHOICES:
        r = simulate(REGIONS_JOB, model, STALWART, Policy("adaptive"), runs=16, regions=replace(calm, choice=choice))
        assert r.ettr == alone.ettr and r.badput["waiting_for_region"] == r.badput["failover_queue"] == 0.0
    c = _choices(calm)
    single, mirror, standby = c["single"], c["mirror"], c["standby"]
    assert single.ettr == mirror.ettr == standby.ettr and single.outages == 0
    assert single.cost_per_useful_gpu_hour < mirror.cost_per_useful_gpu_hour < standby.cost_per_useful_gpu_hour
    assert single.transfer_cost == 0 < mirror.transfer_cost and mirror.storage_cost == 2 * single.storage_cost


def test_choices_side_by_side_are_each_as_alone() -> None:
    model = FailureModel.named("llama3")
    blocks = [Regions(choice=c, outages_per_year=r) for c, r in (("single", 30.0), ("standby", 5.0), ("mirror", 30.0))]
    together = simulate_side_by_side(REGIONS_JOB, model, STALWART, Policy("adaptive"), blocks, runs=8)
    for regions, (result, runs) in zip(blocks, together, strict=True):
        alone = simulate(REGIONS_JOB, model, STALWART, Policy("adaptive"), runs=8, regions=regions)
        assert result == alone and runs.ettr.mean() == alone.ettr
    assert together[0][0].ettr < together[2][0].ettr, "the mirror keeps more of the same outages' time"


@pytest.mark.parametrize("choice", CHOICES)
def test_regional_outages_are_accounted_for_in_the_wall_clock(choice: str) -> None:
    regions = Regions(choice=choice, outages_per_year=50.0, outage_hours=24.0)
    r = simulate(REGIONS_JOB, FailureModel.named("llama3"), STALWART, Policy("adaptive"), runs=8, regions=regions)
    assert r.ettr + sum(r.badput.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(v >= -1e-12 for v in r.badput.values())
    waited, went = r.by_cause["regional outage: waited"], r.by_cause["regional outage: failed over"]
    assert waited + went > 2 and (went == 0) == (choice == "single")


def test_with_frequent_long_outages_a_mirror_pays_and_a_standby_recovers_fastest() -> None:
    c = _choices(Regions(outages_per_year=50.0, outage_hours=24.0))
    single, mirror, standby = c["single"], c["mirror"], c["standby"]
    assert min(single.outages, mirror.outages, standby.outages) > 2
    assert mirror.ettr > single.ettr + 0.05 and standby.ettr > mirror.ettr
    assert standby.hours_down_per_outage < mirror.hours_down_per_outage < single.hours_down_per_outage
    assert standby.failovers == standby.outages > mirror.failovers > single.failovers == 0
    assert mirror.work_lost_per_outage_h > single.work_lost_per_outage_h, "the mirror lags the primary"
    assert mirror.cost_per_useful_gpu_hour < single.cost_per_useful_gpu_hour


def test_the_break_even_rate_is_where_the_costs_cross() -> None:
    model = FailureModel.named("llama3")
    s = study(REGIONS_JOB, model, STALWART, Policy("adaptive"), Regions(), Prices(), runs=16)
    assert [b.choice for b in s.break_even] == ["mirror", "standby"]
    for even in s.break_even:
        assert even.per_year is not None and even.above is not None
        assert even.below <= even.per_year <= even.above <= even.below * 1.02
        for factor, dearer in ((0.8, True), (1.25, False)):
            c = _choices(Regions(outages_per_year=even.per_year * factor))
            gap = c[even.choice].cost_per_useful_gpu_hour - c["single"].cost_per_useful_gpu_hour
            assert (gap > 0) == dearer, (even, factor, gap)
    mirror, standby = s.break_even
    assert mirror.per_year is not None and standby.per_year is not None and standby.per_year > mirror.per_year
    free = study(REGIONS_JOB, model, STALWART, Policy("adaptive"), Regions(), Prices(transfer_gb=0.0), runs=16)
    assert free.break_even[0].per_year is not None and free.break_even[0].per_year < mirror.per_year / 10


def test_stalwart_sim_with_regions_reports_each_choice_and_the_break_even() -> None:
    out = _sim("--regions", "--runs", "8", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["gpus"] == 16384 and len(report["results"]) == len(PROFILES) * len(POLICIES), "the usual rows too"
    regions = report["regions"]
    assert [c["choice"] for c in regions["choices"]] == list(CHOICES)
    assert (regions["profile"], regions["policy"], regions["spares"]) == ("stalwart", "adaptive", report["spares"])
    assert regions["regions"]["outages_per_year"] == 1.0 and regions["prices"]["transfer_gb"] == 0.02
    for even in regions["break_even"]:
        assert even["below"] <= even["per_year"] <= even["above"]
    small = ("--gpus", "4096", "--days", "30", "--spares", "8", "--profile", "stalwart", "--policy", "adaptive")
    implied = _sim("--region-outages-per-year", "20", "--runs", "4", *small)
    assert implied.returncode == 0, implied.stderr
    assert "regional outages: 20 a year" in implied.stdout and "mirror pays for itself above" in implied.stdout
