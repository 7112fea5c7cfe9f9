"""`megatron-kl audit --dynamics`: every configuration trained from pi_ref with its exact expected direction, in a
table with the audit's verdict and where the run ended; the JSON agrees with the table's claims."""

import json

from megatron_kl.cli import main


def test_the_dynamics_table_names_where_each_configuration_ends(tmp_path, capsys):
    out = tmp_path / "dynamics.json"
    assert (
        main(
            [
                "audit",
                "--dynamics",
                "--vocab",
                "2",
                "--length",
                "2",
                "--seed",
                "3",
                "--steps",
                "500",
                "--lr",
                "4",
                "--sampled",
                "32",
                "--seeds",
                "2",
                "--sampled-steps",
                "20",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    sampled = printed.split("== sampled on-policy training")[1]
    assert "full-loss-sequence" in sampled and "/2" in sampled
    rows = json.loads(out.read_text())
    assert {r["mode"] for r in rows} == {"on_policy", "off_policy"}
    for mode in ("on_policy", "off_policy"):
        part = [r for r in rows if r["mode"] == mode]
        assert part[0]["name"] == "no-kl" and part[0]["fixed_point"].startswith("none")
        unbiased = [r for r in part[1:] if "seq" in r["verdict"].split(": ")[-1].split(",")]
        assert unbiased
        for r in part[1:]:
            assert (r["fixed_point"] == "pi* (the regularised optimum)") == (r in unbiased), r
            assert (r["kl_to_optimum"] < 1e-8) == (r in unbiased), r
            assert r["name"] in printed


def test_stale_sample_table_and_figures(tmp_path, capsys):
    """--stale S...: one row per staleness x correction x configuration (the control first), the instability count
    out of the seeds; --figures writes both figures."""
    figures = tmp_path / "figures"
    assert (
        main(
            [
                "audit",
                "--dynamics",
                "--vocab",
                "2",
                "--length",
                "2",
                "--steps",
                "5",
                "--sampled",
                "8",
                "--seeds",
                "2",
                "--sampled-steps",
                "5",
                "--stale",
                "0",
                "3",
                "--stale-configs",
                "k2-loss-sequence",
                "k1-reward-token-rtg-per_decision",
                "--stale-corrections",
                "none",
                "sequence_tis",
                "--figures",
                str(figures),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    table = printed.split("== stale samples")[1].splitlines()[3:]
    rows = [line.split() for line in table if line.strip() and not line.startswith("wrote")]
    assert len(rows) == 2 * 2 * 3
    assert [(r[0], r[2]) for r in rows[:3]] == [
        ("0", "no-kl"),
        ("0", "k2-loss-sequence"),
        ("0", "k1-reward-token-rtg-per_decision"),
    ]
    assert {r[0] for r in rows} == {"0", "3"} and all(r[-1].endswith("/2") for r in rows)
    for name in ("dynamics-exact.png", "dynamics-stale.png"):
        assert (figures / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_stale_options_without_their_prerequisites_are_refused(capsys):
    import pytest

    for argv, message in (
        (["--stale", "2"], "--stale needs --sampled"),
        (["--sampled", "8", "--stale-only"], "--stale-only needs --stale"),
        (
            ["--sampled", "8", "--stale", "2", "--stale-only", "--stale-configs", "k9-loss"],
            "unknown configuration(s) ['k9-loss']",
        ),
    ):
        with pytest.raises(SystemExit) as err:
            main(["audit", "--dynamics", "--vocab", "2", "--length", "2", *argv])
        assert message in str(err.value), argv
