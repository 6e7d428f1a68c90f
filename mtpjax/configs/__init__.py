"""The serving configs shipped with the package (`glm.py`), so an installed mtpjax serves from
any working directory; `configs/glm.py` in a checkout is the same config."""
