"""A user's own scheme, in their own module and config directory, runs with no package edit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from datc.config import ConfigError
from datc.credit import CREDIT_SCHEMES, CreditBatch, compute_credit, resolve_scheme
from tests.helpers.user_scheme import USER_MODULE


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_schemes.py").write_text(USER_MODULE)
    (tmp_path / "my_configs" / "credit").mkdir(parents=True)
    (tmp_path / "my_configs" / "credit" / "entropy_weighted.yaml").write_text(
        "_target_: my_schemes.entropy_weighted  # the user's scheme\nname: entropy_weighted  # label in run names\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_target_resolves_and_computes_without_registration(user_dir):
    scheme, params = resolve_scheme({"_target_": "my_schemes.entropy_weighted", "name": "entropy_weighted"})
    assert "entropy_weighted" not in CREDIT_SCHEMES  # not registered, found by import
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    # Hand values: entropies [1, 2, 3] -> w = e / 6 * 3 = [0.5, 1, 1.5]; [2, 2] -> [1, 1].
    ent = torch.tensor([[1.0, 2.0, 3.0, 9.0], [2.0, 2.0, 5.0, 5.0]])
    out = compute_credit(scheme, CreditBatch(torch.zeros(2, 4, dtype=torch.long), mask, torch.tensor([1.0, -1.0]), entropy=ent), params)
    torch.testing.assert_close(out.weights, torch.tensor([[0.5, 1.0, 1.5, 0.0], [1.0, 1.0, 0.0, 0.0]]))


def test_target_that_is_not_a_scheme_is_a_clear_error(user_dir):
    from datc.checks import validate
    from tests.helpers.testbed import compose_train

    with pytest.raises(ConfigError, match="not a CreditScheme"):
        validate(compose_train(["+credit._target_=torch.ones"]))


@pytest.mark.slow
def test_user_scheme_trains_from_the_command_line(user_dir, prepared_cache, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{user_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "datc.train", f"hydra.searchpath=[file://{user_dir}/my_configs]",
                        "credit=entropy_weighted", "debug=fast", f"cache_dir={prepared_cache}", f"run_dir={run}"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    train_rows = [x for x in rows if "credit/weight_std" in x]
    assert train_rows and all(x["credit/weight_std"] > 0 for x in train_rows)  # the user's weights were used
