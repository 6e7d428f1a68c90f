"""Where the reference fixtures are: `tests/fixtures/` in the repository (see its README for
where each file came from and how to make them again); MTPJAX_FIXTURES overrides it."""

import os
import pathlib

FIXTURES = pathlib.Path(os.environ.get(
    "MTPJAX_FIXTURES", pathlib.Path(__file__).resolve().parent / "fixtures"))
