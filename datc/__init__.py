"""Config-driven RL for language models with token-level credit assignment."""

from datc.run.naming import register_resolvers

register_resolvers()  # ${datc.config_id:} in run names, before any config is composed
