"""The test config: the embedded tiny demo with small engine sizes (`configs/glm.py:tiny`)."""

from __future__ import annotations

import ml_collections

from configs import glm


def get_config() -> ml_collections.ConfigDict:
  return glm.get_config("tiny")
