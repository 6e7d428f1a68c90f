"""Where the shared reference fixtures are: `../shared/fixtures` beside the checkout.

CI clones the repository into another folder with a copy of shared/ beside it, so the path is
found relative to this file; MTPJAX_FIXTURES overrides it.
"""

import os
import pathlib

FIXTURES = pathlib.Path(os.environ.get(
    "MTPJAX_FIXTURES", pathlib.Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
