"""The user's credit scheme of docs/writing-a-scheme.md, as a module's source: the user-scheme tests
train with it and the docs tests check that the page shows it."""

from __future__ import annotations

import textwrap

USER_MODULE = textwrap.dedent('''
    import torch
    from datc.credit import credit_scheme
    from datc.credit.base import ENTROPY

    @credit_scheme("entropy_weighted", needs={ENTROPY}, output="weights", normalization="per_response")
    def entropy_weighted(batch, params):
        """Weight tokens by rollout entropy, mean 1 over each response's valid tokens."""
        w = batch.entropy * batch.response_mask
        return w / w.sum(-1, keepdim=True).clamp(min=1e-8) * batch.response_mask.sum(-1, keepdim=True)
''')
