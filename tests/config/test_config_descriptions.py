"""Each config field is described once: in the schema (``datc/config.py``) where no config file
sets it, or in its group's default option, never both (two descriptions drift apart)."""

from __future__ import annotations

from collections import defaultdict

from scripts.docs import reference


def described_twice(sources: list[tuple[int, str, str, str]]) -> dict[str, list[str]]:
    """Fields with a description both in the schema (rank 1) and in their group's default option (rank 0)."""
    where: dict[str, dict[int, str]] = defaultdict(dict)
    for rank, rel, key, comment in sources:
        if rank in (0, 1) and not reference._is_note(comment):
            where[key][rank] = rel
    return {k: sorted(v.values()) for k, v in where.items() if len(v) == 2}


def test_no_field_is_described_in_both_the_schema_and_its_default_option():
    twice = described_twice(reference._comment_sources())
    assert not twice, twice


def test_the_rule_finds_a_field_described_twice():
    sources = [(0, "rollout/torch.yaml", "rollout.name", "the engine"), (1, "datc/config.py", "rollout.name", "torch or vllm"),
               (1, "datc/config.py", "trainer.lr", "the rate"), (2, "rollout/vllm.yaml", "rollout.name", "vllm")]
    assert described_twice(sources) == {"rollout.name": ["datc/config.py", "rollout/torch.yaml"]}


def test_every_described_field_keeps_its_description_in_the_reference():
    d = reference.field_descriptions()
    for key in ("rollout.max_staleness", "backend.timeout_s", "policy.lora.r", "trainer.micro_batch_size"):
        assert d[key][0] and d[key][1] != "datc/config.py", (key, d[key])


def test_the_reference_shows_no_home_path_a_valid_range_for_room_checked_fields_and_breaks_names_at_dots():
    from pathlib import Path

    md = reference.config_reference_md()
    assert str(Path.home()) + "/" not in md  # cache_dir's default: ~/.cache/datc, not the builder's home
    fields = {f.name: f for f in reference.config_fields()}
    assert fields["rollout.max_staleness"].valid  # refused by datc/engines/checks.py, said in the table
    row = next(ln for ln in md.splitlines() if "rollout.<wbr>max_staleness" in ln)
    assert row.startswith('| <code class="field">rollout.<wbr>max_staleness</code>')
