"""`--config=configs/glm.py[:variant]`: the serving config, kept in the package
(`mtpjax/configs/glm.py`) so that an installed mtpjax has it too; this file lets a checkout's
commands and tests name it by this path."""

from mtpjax.configs.glm import MODEL_NAME, VARIANTS, get_config  # noqa: F401
