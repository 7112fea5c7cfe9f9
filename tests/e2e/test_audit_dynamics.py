"""`megatron-kl audit --dynamics`: every configuration trained from pi_ref with its exact expected direction, in a
table with the audit's verdict and where the run ended; the JSON agrees with the table's claims."""

import json

from megatron_kl.cli import main


def test_the_dynamics_table_names_where_each_configuration_ends(tmp_path, capsys):
    out = tmp_path / "dynamics.json"
    assert main(["audit", "--dynamics", "--vocab", "2", "--length", "2", "--seed", "3", "--steps", "500", "--lr", "4",
                 "--sampled", "32", "--seeds", "2", "--sampled-steps", "100", "--json", str(out)]) == 0
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
