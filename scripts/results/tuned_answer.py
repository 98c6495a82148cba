"""The answer table that opens ``results/tuned/README.md``: every setting a column, every scheme a
row, the paired difference in final held-out gold to tuned GRPO and to GRPO at matched KL, with
intervals, and what the runs cost. Read from the committed tables and records only:

    python -m scripts.results.tuned_answer            # writes results/tuned/answer.md
    python -m scripts.results.tuned_answer --check    # exit 1 if the committed file is stale

Per setting ``<s>``: ``results/tuned/<s>/evaluation/report.json`` (each scheme's paired difference
to tuned GRPO on the evaluation seeds, its length-collapsed runs), ``results/tuned/<s>/tuned.json``
(the matched-KL control: the difference to GRPO at the matched rate, both KLs, the protocol's
tolerance) and ``results/tuned/records/<s>/**/summary.json`` (runs and their training wall time); a
superseded study's under ``results/tuned/legacy_<reward model>/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUNED = ROOT / "results" / "tuned"
OUT = TUNED / "answer.md"
# a column's tables and records under results/tuned/: <s>/ and records/<s>/, or for a superseded
# study (its reward model not re-creatable) legacy_<rm>/<s>/ and legacy_<rm>/records/<s>/
SETTINGS = ["keywords-tiny_gpt2", "keywords-tiny_llama", "arithmetic-tiny_gpt2", "arithmetic-tiny_llama",
            "reviews-smollm2_135m_instruct", "legacy_rm5e1e6828/reviews-smollm2_135m_instruct",
            "legacy_rm09ab3fe7/reviews-smollm2_135m_instruct"]
TITLES = {"keywords-tiny_gpt2": "keywords / tiny GPT-2", "keywords-tiny_llama": "keywords / tiny Llama",
          "arithmetic-tiny_gpt2": "arithmetic / tiny GPT-2", "arithmetic-tiny_llama": "arithmetic / tiny Llama",
          "reviews-smollm2_135m_instruct": "reviews / SmolLM2-135M (real; reward model {pinned_rm}, from the committed delta)",
          "legacy_rm5e1e6828/reviews-smollm2_135m_instruct": "reviews / SmolLM2-135M (real; earlier reward model 5e1e6828, "
                                                             "not re-creatable)",
          "legacy_rm09ab3fe7/reviews-smollm2_135m_instruct": "reviews / SmolLM2-135M (real; old reward model 09ab3fe7, lr from 1e-5)"}


PREPARED = ROOT / "results" / "real_model" / "prepared.json"  # the real preset's pinned files


def title(name: str) -> str:
    """A column's title; the real model's names its reward model by the first 8 hex digits of the
    sha256 pinned in ``results/real_model/prepared.json``."""
    text = TITLES.get(name, name)
    if "{pinned_rm}" in text:
        text = text.format(pinned_rm=json.loads(PREPARED.read_text())["files"]["reward/model.safetensors"][:8])
    return text


def _records(name: str) -> Path:
    head, _, setting = name.rpartition("/")
    return TUNED / head / "records" / setting
ORDER = ["oracle", "rm_counterfactual", "datc", "datc_end_neutral", "datc_identity", "p2t", "grail"]


def _iv(d: dict | None) -> str:
    if not d or d.get("mean") is None:
        return "n/a"
    hw = d.get("half_width")
    text = f"{d['mean']:+.3f}" + (f" ± {hw:.3f}" if hw is not None else "")
    return f"**{text}**" if hw is not None and abs(d["mean"]) > hw else text  # the interval excludes zero


def _setting(name: str) -> dict:
    folder = TUNED / name
    tuned = json.loads((folder / "tuned.json").read_text())["settings"][0]
    report = folder / "evaluation" / "report.json"
    evaluated = report.is_file()  # a study under way: its selection only, so far
    rows = {r["scheme"]: r for r in json.loads(report.read_text())["rows"]} if evaluated else {}
    matched = {m["scheme"]: m for m in tuned.get("matched_kl", [])}
    walls = [json.loads(p.read_text()).get("wall_time_s") for p in _records(name).rglob("summary.json")]
    walls = [w for w in walls if isinstance(w, (int, float))]
    grpo = rows.get("grpo", {}).get("metrics", {}).get("final_gold")
    manifest = _records(name) / "tuning.json"
    planned = sum(len(v) for v in (json.loads(manifest.read_text()).get("evaluation") or {}).get("seeds", {}).values()) \
        if manifest.is_file() else 0
    return {"rows": rows, "matched": matched, "runs": len(walls), "hours": sum(walls) / 3600,
            "under_way": set() if evaluated else set(tuned["schemes"]),
            "median_s": statistics.median(walls) if walls else None, "grpo": grpo,
            "pairs": len(rows.get("grpo", {}).get("seeds", [])), "planned": planned}


def _partial(s: dict, n: int | None) -> bool:
    """An evaluation still under way: fewer pairs than the study's evaluation seeds (no claim yet)."""
    return bool(s.get("planned")) and n is not None and n < s["planned"]


def _cell(s: dict, scheme: str) -> str:
    row = s["rows"].get(scheme)
    if row is None:
        return "under way (no evaluation yet)" if scheme in s.get("under_way", ()) else "not run"
    vs = row.get("vs_baseline", {}).get("final_gold")
    if vs and _partial(s, vs.get("n")):  # no bold, no matched KL: the interval of a part is no claim
        return f"under way ({vs['n']} of {s['planned']} pairs: {_iv({**vs, 'half_width': None})} so far)"
    text = _iv(vs)
    m = s["matched"].get(scheme)
    if m is not None and m.get("lr") is None:
        text += "; matched KL: no GRPO rate reached its KL (see the setting's table)"
    elif m is not None:
        share = (m["vs_matched"]["mean"] / m["gain"]["mean"]) \
            if m.get("resolved", True) and m.get("vs_matched") and m["gain"]["mean"] else None  # no share of a loss
        kls = [(m.get(k) or {}).get("mean") for k in ("kl_matched", "kl_scheme")]
        ratio = kls[0] / kls[1] if None not in kls and kls[1] else None
        text += f"; matched KL {_iv(m.get('vs_matched'))}"
        n_m, n_g = (m.get("vs_matched") or {}).get("n"), (m.get("gain") or {}).get("n")
        if n_m is not None and n_g is not None and n_m < n_g:  # its evaluation not finished: say on how many pairs
            text += f" ({n_m} of {n_g} pairs)"
        if ratio is not None:
            text += f" (KL ratio {ratio:.2f}"
            text += f", credit share {share:.2f})" if share is not None else ")"
    if row.get("length_collapsed"):
        text += f" ({len(row['length_collapsed'])} collapsed)"
    return text


def answer_md() -> str:
    settings = {n: _setting(n) for n in SETTINGS if (TUNED / n / "tuned.json").exists()}
    cols = list(settings)
    lines = ["| scheme | " + " | ".join(title(c) for c in cols) + " |", "|---|" + "---|" * len(cols)]
    lines.append("| tuned `grpo`: final gold (pairs) | " + " | ".join(
        f"{settings[c]['grpo']['mean']:.3f} ({settings[c]['pairs']}"
        + (f" of {settings[c]['planned']}, under way)" if _partial(settings[c], settings[c]['pairs']) else ")")
        if settings[c]["grpo"]
        else _cell(settings[c], "grpo") for c in cols) + " |")
    for scheme in ORDER:
        lines.append(f"| `{scheme}` | " + " | ".join(_cell(settings[c], scheme) for c in cols) + " |")
    lines.append("| runs (training wall time, median a run) | " + " | ".join(
        f"{settings[c]['runs']} ({settings[c]['hours']:.1f} h, {settings[c]['median_s']:.0f} s)" if settings[c]["runs"]
        else "0" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.results.tuned_answer", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if results/tuned/answer.md is not what the tables give")
    args = p.parse_args(argv)
    text = answer_md()
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT.relative_to(ROOT)}: {'up to date' if same else 'stale'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
