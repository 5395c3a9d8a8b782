"""Compare ckptdoctor with picklescan and modelscan on our payload corpus and on clean real checkpoints.

Usage (bench only; the scanners are not package dependencies)::

    pip install picklescan modelscan
    python bench/compare_scanners.py            # prints the tables and rewrites them in bench/SECURITY.md

A payload counts as caught when the tool reports that file as dangerous (picklescan: a dangerous global;
modelscan: any issue; ckptdoctor: CKD601 or CKD605). A clean file counts as a false alarm on the same criterion;
picklescan's "suspicious" globals and ckptdoctor's CKD602 warnings are listed separately.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptdoctor.scanner import scan  # noqa: E402

SECURITY_MD = ROOT / "bench" / "SECURITY.md"
BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"


def build_payloads(folder: Path, canary: Path) -> dict[str, str]:
    """Write every payload under ``folder``; returns relative path -> technique."""
    from tests import payloads
    from tests.test_security_payloads import _extra_torch_payloads, _slug

    out = {}
    for p in payloads.corpus(canary) + _extra_torch_payloads(canary):
        path = folder / _slug(p.name) / p.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(p.data)
        if path.name == ".metadata" or path.suffix == ".distcp":
            (path.parent / "__1_0.distcp").write_bytes(b"")
        out[str(path.relative_to(folder))] = p.name
    return out


def build_clean(folder: Path, deepspeed: bool) -> dict[str, str]:
    """Fixtures plus freshly written real files; returns relative path -> description (pickle-bearing files only)."""
    from bench import make_allowlist
    from tests import payloads

    shutil.copytree(ROOT / "fixtures", folder / "fixtures")
    fresh = folder / "fresh" / "checkpoint-2"
    fresh.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        payloads.save_training_files(fresh)
        payloads.save_model_state(fresh / "pytorch_model.bin")
        payloads.save_dcp(fresh / "pytorch_model_fsdp_0")
        make_allowlist.write_peft_adapter(fresh)
        make_allowlist.write_torch_files(folder / "fresh" / "library")
        make_allowlist.run_trainer(folder / "fresh")
        make_allowlist.write_accelerate_state(folder / "fresh")
    if deepspeed:
        make_allowlist.write_deepspeed(folder / "fresh")
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix not in (".json", ".safetensors", ".py", ".md", ".txt") and p.name != "latest":
            out[str(p.relative_to(folder))] = p.name
    return out


def run_picklescan(folder: Path) -> dict[str, str] | None:
    """relative path -> "dangerous" / "suspicious" for the files picklescan flags; None when not installed.

    Uses picklescan's own per-file API (its CLI prints suspicious globals only as a total).
    """
    try:
        from picklescan.scanner import SafetyLevel, scan_file_path
    except ImportError:
        return None
    out: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        try:
            res = scan_file_path(str(path))
        except Exception:
            continue
        rel = str(path.relative_to(folder))
        levels = {g.safety for g in res.globals}
        if res.infected_files or SafetyLevel.Dangerous in levels:
            out[rel] = "dangerous"
        elif SafetyLevel.Suspicious in levels:
            out[rel] = "suspicious"
    return out


def run_modelscan(folder: Path) -> tuple[dict[str, str], set[str]] | None:
    """(relative path -> "dangerous" for files with issues, files it scanned); None when not installed."""
    exe = shutil.which("modelscan")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        subprocess.run([exe, "-p", str(folder), "-r", "json", "-o", str(report)], capture_output=True, timeout=1800)
        doc = json.loads(report.read_text()) if report.exists() else {}
    flagged = {}
    for issue in doc.get("issues", []):
        src = issue.get("source", "")
        flagged[src.split(":", 1)[0]] = "dangerous"
    scanned = {n.split(":", 1)[0] for n in doc.get("summary", {}).get("scanned", {}).get("scanned_files", [])}
    return {_rel(k, folder): v for k, v in flagged.items()}, {_rel(k, folder) for k in scanned}


def _rel(path: str, folder: Path) -> str:
    p = Path(path)
    return str(p.relative_to(folder)) if p.is_absolute() and p.is_relative_to(folder) else path


def run_ckptdoctor(folder: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in scan(str(folder)).findings:
        if f.rule in ("CKD601", "CKD605"):
            out[f.path] = "dangerous"
        elif f.rule == "CKD602" and f.path not in out:
            out[f.path] = "suspicious"
    return out


def _mark(verdict: str | None, scanned: bool = True) -> str:
    if not scanned:
        return "not scanned"
    return {"dangerous": "**flagged**", "suspicious": "warning"}.get(verdict or "", "-")


def table(files: dict[str, str], results: dict[str, tuple[dict[str, str], set[str] | None] | None]) -> list[str]:
    tools = [t for t, r in results.items() if r is not None]
    lines = ["| file | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    for rel, label in files.items():
        cells = []
        for t in tools:
            got, scanned = results[t]  # type: ignore[misc]
            cells.append(_mark(got.get(rel), scanned is None or rel in scanned or rel in got))
        lines.append(f"| {label} (`{rel}`) | " + " | ".join(cells) + " |")
    return lines


def totals(files: dict[str, str], results: dict[str, tuple[dict[str, str], set[str] | None] | None]) -> dict[str, int]:
    return {t: sum(1 for rel in files if r[0].get(rel) == "dangerous") for t, r in results.items() if r is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print only; do not rewrite bench/SECURITY.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bad, clean = Path(tmp) / "payloads", Path(tmp) / "clean"
        canary = Path(tmp) / "canary"
        bad_files = build_payloads(bad, canary)
        clean_files = build_clean(clean, deepspeed=not args.no_deepspeed)
        sections = []
        for title, folder, files in (("Payload corpus", bad, bad_files), ("Clean real files", clean, clean_files)):
            ps = run_picklescan(folder)
            ms = run_modelscan(folder)
            results: dict[str, tuple[dict[str, str], set[str] | None] | None] = {
                "ckptdoctor": (run_ckptdoctor(folder), None),
                "picklescan": (ps, None) if ps is not None else None,
                "modelscan": ms,
            }
            tot = totals(files, results)
            word = "caught" if folder is bad else "false alarms"
            warned = {t: sum(1 for rel in files if r[0].get(rel) == "suspicious") for t, r in results.items() if r}
            summary = ", ".join(f"{t}: {n}/{len(files)} {word} ({warned[t]} warnings)" for t, n in tot.items())
            sections += [f"### {title}", "", summary, "", *table(files, results), ""]
        assert not canary.exists(), "a scanner executed a payload"
    text = "\n".join(sections)
    print(text)
    if not args.no_write and SECURITY_MD.exists():
        doc = SECURITY_MD.read_text()
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            tail = rest.split(END, 1)[1]
            SECURITY_MD.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    main()
