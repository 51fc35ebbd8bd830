"""The settings of ``policy=elastic``: none beyond the name (the layout is ``train.stages``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ElasticConfig:
    _target_: str = "ftlab.policies.elastic.policy.Elastic"
    name: str = "elastic"


SCHEMAS = {"policy": ElasticConfig}
