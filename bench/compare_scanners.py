"""Compare ckptdoctor with picklescan and modelscan on our payload corpus and on clean real checkpoints.

Usage (bench only; the scanners are not package dependencies)::

    pip install picklescan modelscan
    python bench/compare_scanners.py            # prints the tables and rewrites them in bench/SECURITY.md
    python bench/compare_scanners.py --peers --peers-python VENV/bin/python
        # the peers' own corpora (bench/peer_corpus.py): one row per peer, rewritten in docs/security.md;
        # VENV has picklescan, fickling, modelscan and modelaudit installed (each is skipped when it is not)

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
DOCS_SECURITY_MD = ROOT / "docs" / "security.md"
PEERS_BEGIN, PEERS_END = "<!-- peers:begin -->", "<!-- peers:end -->"
SECURITY_ERRORS = ("CKD601", "CKD603", "CKD605")


def build_payloads(folder: Path, canary: Path) -> dict[str, str]:
    """Write every payload under ``folder``; returns relative path -> technique."""
    from tests.helpers import payloads
    from tests.pickle_verdict.test_security_payloads import _extra_torch_payloads, _slug

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
    from tests.helpers import payloads

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


def run_modelscan(folder: Path, exe: str | None = None) -> tuple[dict[str, str], set[str]] | None:
    """(relative path -> "dangerous" for files with issues, files it scanned); None when not installed."""
    exe = exe or shutil.which("modelscan")
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


# ---------------------------------------------------------------------------------------------------------------
# The peers' own corpora

# Run inside the peers' venv: prints {tool: {relative path: flagged}} for the in-process tools, null when absent.
_PEER_SNIPPET = r"""
import json, sys
from pathlib import Path
folder = Path(sys.argv[1])
files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
out = {}
try:
    from picklescan.scanner import SafetyLevel, scan_file_path
    res = {}
    for p in files:
        try:
            r = scan_file_path(str(p))
            res[str(p.relative_to(folder))] = bool(r.infected_files or any(g.safety == SafetyLevel.Dangerous
                                                                            for g in r.globals))
        except Exception:
            res[str(p.relative_to(folder))] = False
    out["picklescan"] = res
except ImportError:
    out["picklescan"] = None
try:
    import fickling
    from fickling.analysis import Severity
    res = {}
    for p in files:
        try:
            res[str(p.relative_to(folder))] = fickling.scan_file(str(p), graceful=True).severity > Severity.LIKELY_SAFE
        except Exception:
            res[str(p.relative_to(folder))] = False
    out["fickling"] = res
except ImportError:
    out["fickling"] = None
print(json.dumps(out))
"""


def run_peer_tools(folder: Path, python: str) -> dict[str, dict[str, bool] | None]:
    """Each peer's verdict (flagged or not) per file under ``folder``, run with ``python`` (the peers' venv)."""
    proc = subprocess.run([python, "-c", _PEER_SNIPPET, str(folder)], capture_output=True, text=True, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    out: dict[str, dict[str, bool] | None] = json.loads(lines[-1]) if lines else {"picklescan": None, "fickling": None}
    bindir = Path(python).parent
    ms = run_modelscan(folder, str(bindir / "modelscan")) if (bindir / "modelscan").exists() else None
    out["modelscan"] = {k: v == "dangerous" for k, v in ms[0].items()} if ms is not None else None
    out["modelaudit"] = run_modelaudit(folder, bindir / "modelaudit") if (bindir / "modelaudit").exists() else None
    return out


def run_modelaudit(folder: Path, exe: Path) -> dict[str, bool]:
    """relative path -> True for every file ModelAudit reports a critical or warning issue on."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        subprocess.run([str(exe), "scan", str(folder), "--format", "json", "--no-cache", "-o", str(report)],
                       capture_output=True, timeout=1800)  # fmt: skip
        doc = json.loads(report.read_text()) if report.exists() else {}
    out: dict[str, bool] = {}
    for issue in doc.get("issues", []):
        if issue.get("severity") in ("critical", "warning"):
            where = str(issue.get("location") or "").split(" (pos", 1)[0].split(":", 1)[0]
            for p in folder.rglob("*"):
                if p.is_file() and where.startswith(str(p)):
                    out[str(p.relative_to(folder))] = True
    return out


def peers_table(python: str) -> str:
    """The per-peer table of docs/security.md: samples, flagged by the peer, flagged by ckptdoctor, missed."""
    from bench import peer_corpus

    with tempfile.TemporaryDirectory() as tmp:
        folder, canary = Path(tmp) / "corpus", Path(tmp) / "canary"
        written = peer_corpus.write(folder, canary)
        ours = {f.path for f in scan(str(folder)).findings if f.rule in SECURITY_ERRORS and f.severity.value == "error"}
        tools = run_peer_tools(folder, python)
        assert not canary.exists(), "a scanner executed a payload"
    rows = [
        "| peer's corpus | samples | flagged by the peer | flagged by ckptdoctor | missed by ckptdoctor |",
        "|---|---|---|---|---|",
    ]
    missed_lines = []
    for peer in peer_corpus.PEERS:
        mine = [(s, str(p.relative_to(folder))) for s, p in written if s.peer == peer]
        verdicts = tools.get(peer)
        by_peer = "not installed" if verdicts is None else str(sum(1 for _, rel in mine if verdicts.get(rel)))
        caught = sum(1 for _, rel in mine if rel in ours)
        missed = [s for s, rel in mine if rel not in ours]
        rows.append(f"| {peer} | {len(mine)} | {by_peer} | {caught} | {len(missed)} |")
        missed_lines += [f"- {peer} `{s.ident}`: {s.klass}" for s in missed]
    others = [t for t in peer_corpus.PEERS if tools.get(t) is not None]
    cross = ["", "Each tool on the whole corpus (all four peers' samples, "
             f"{len(written)} files): ckptdoctor {sum(1 for _, p in written if str(p.relative_to(folder)) in ours)}"]
    cross[-1] += "".join(f", {t} {sum(1 for v in (tools[t] or {}).values() if v)}" for t in others) + "."
    return "\n".join(rows + cross + ["", "Missed by ckptdoctor:", "", *(missed_lines or ["- none"])])


def write_peers_section(text: str) -> None:
    """Rewrite the block between the peers markers of docs/security.md."""
    if not DOCS_SECURITY_MD.exists():
        return
    doc = DOCS_SECURITY_MD.read_text()
    if PEERS_BEGIN in doc and PEERS_END in doc:
        head, rest = doc.split(PEERS_BEGIN, 1)
        DOCS_SECURITY_MD.write_text(f"{head}{PEERS_BEGIN}\n{text}\n{PEERS_END}{rest.split(PEERS_END, 1)[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print only; do not rewrite bench/SECURITY.md")
    ap.add_argument("--peers", action="store_true", help="the peers' corpora table of docs/security.md instead")
    ap.add_argument("--peers-python", default=sys.executable, help="python of the venv the peer scanners are in")
    args = ap.parse_args()
    if args.peers:
        text = peers_table(args.peers_python)
        print(text)
        if not args.no_write:
            write_peers_section(text)
        return
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
