"""The rule registry: every rule documented with the fixed sections, codes and names stable and well-formed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ckptdoctor.rules import DOC_SECTIONS, all_rules, get_rule


def test_every_rule_has_a_document_with_all_sections() -> None:
    for r in all_rules():
        assert r.summary, f"{r.code} has no summary line"
        for section in DOC_SECTIONS:
            assert f"## {section}" in r.doc, f"{r.code} doc lacks '## {section}'"


def test_codes_and_names_are_well_formed_and_unique() -> None:
    rules = all_rules()
    assert len({r.code for r in rules}) == len(rules)
    assert len({r.name for r in rules}) == len(rules)
    for r in rules:
        assert re.fullmatch(r"CKD\d{3}", r.code), r.code
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", r.name), r.name


def test_catalog_codes_are_the_contract() -> None:
    expected = {
        "CKD001": "unreadable-path",
        "CKD101": "stale-checkpoint-selected",
        "CKD102": "incomplete-checkpoint",
        "CKD103": "leftover-temp-checkpoint",
        "CKD104": "step-mismatch",
        "CKD105": "best-checkpoint-missing",
        "CKD106": "no-resumable-checkpoint",
        "CKD201": "stub-weights-shadow-adapter",
        "CKD202": "corrupt-safetensors",
        "CKD203": "corrupt-torch-archive",
        "CKD204": "missing-shard",
        "CKD205": "shard-index-mismatch",
        "CKD206": "conflicting-weights-files",
        "CKD207": "prefixed-state-dict-keys",
        "CKD208": "config-shape-mismatch",
        "CKD210": "empty-weights-file",
        "CKD301": "adapter-config-invalid",
        "CKD302": "adapter-config-mismatch",
        "CKD401": "lr-schedule-finished",
        "CKD402": "trainer-state-invalid",
        "CKD403": "optimizer-state-incomplete",
        "CKD404": "rng-state-missing",
        "CKD405": "optimizer-param-mismatch",
        "CKD406": "lr-jump-in-history",
        "CKD501": "fsdp-shard-missing",
        "CKD502": "deepspeed-partition-missing",
        "CKD503": "deepspeed-latest-dangling",
        "CKD601": "unsafe-pickle-global",
        "CKD602": "unknown-pickle-global",
        "CKD603": "malformed-pickle",
        "CKD604": "link-escapes-root",
    }
    got = {r.code: r.name for r in all_rules()}
    for code, name in expected.items():
        assert got.get(code) == name, code


def test_lookup_by_code_or_name() -> None:
    r = get_rule("ckd201")
    assert r is not None and r.name == "stub-weights-shadow-adapter"
    assert get_rule("stub-weights-shadow-adapter") is r
    assert get_rule("CKD999") is None


def test_rule_documents_cite_sources_a_user_can_open() -> None:
    """References name library source or our shipped docs, never the team's private notebook."""
    for r in all_rules():
        assert "ANATOMY" not in r.doc, f"{r.code} cites a notebook users do not have"
        refs = r.doc.split("## References", 1)[1]
        # A file a user can open (``src/transformers/trainer.py``, ``safetensors/src/tensor.rs``, ``docs/gate.md``),
        # not only a function name or a principle.
        assert re.search(r"[\w.-]+/[\w./-]+\.(?:py|rs|cc|md|proto)\b", refs), f"{r.code} cites no file"


def test_shipped_package_never_cites_the_notebook() -> None:
    import ckptdoctor

    root = Path(ckptdoctor.__file__).parent
    hits = [str(p.relative_to(root)) for p in root.rglob("*.py") if "ANATOMY" in p.read_text(encoding="utf-8")]
    assert hits == []


def test_explain_through_the_cli_shows_the_library_source() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "explain", "CKD208"], capture_output=True, text=True, check=False
    )
    assert p.returncode == 0, p.stderr
    assert "src/transformers/utils/loading_report.py" in p.stdout
    assert "ANATOMY" not in p.stdout
